"""The one chunked softmax of attention rows, against a plain softmax over the full masked matrix.

Every mask kind :func:`polykv.attention.signals.attention_probabilities` supports (lower-right causal
in storage order, causal by original positions, an explicit visibility mask, padding columns), with
softcapping, sinks and the eager recipe, in one chunk and in chunks of one row.
"""

from __future__ import annotations

import pytest
import torch

from polykv.attention.signals import attention_probabilities, chunked_attention

B, H, Hkv, q, K, d = 2, 6, 3, 5, 9, 8
G = H // Hkv


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    query = torch.randn(B, H, q, d, generator=g).to(dtype)
    key = torch.randn(B, Hkv, K, d, generator=g).to(dtype)
    value = torch.randn(B, Hkv, K, d, generator=g).to(dtype)
    valid = torch.ones(B, Hkv, K, dtype=torch.bool)
    valid[1, 2, :3] = False                                              # ragged padding of one head
    return query, key, value, valid


def _plain(query, key, scaling, visible, *, softcap=None, sinks=None):
    """[B, H, q, K] float64 softmax over the full matrix, keys repeated per head; ``visible`` [B, Hkv, q, K]."""
    logits = torch.matmul(query.double(), key.double().repeat_interleave(G, 1).transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~visible.repeat_interleave(G, 1), float("-inf"))
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    both = torch.cat([logits, sinks.double().view(1, H, 1, 1).expand(B, H, q, 1)], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]


def _gathered(chunks, width=K):
    """Chunks (start, [B, Hkv, G, c, K']) joined into [B, H, q, K] (columns past a chunk's K' are 0)."""
    out = torch.zeros(B, Hkv, G, q, width, dtype=torch.float64)
    for start, probs in chunks:
        out[:, :, :, start:start + probs.shape[3], :probs.shape[4]] = probs.double()
    return out.view(B, H, q, width)


def _causal(valid=None):
    seen = (torch.arange(K)[None, :] <= torch.arange(q)[:, None] + (K - q)).expand(B, Hkv, q, K)
    return seen if valid is None else seen & valid.unsqueeze(2)


@pytest.mark.parametrize("chunk", [1 << 20, 1])
@pytest.mark.parametrize("prefix", [False, True])
def test_lower_right_causal_with_padding(chunk, prefix):
    query, key, _, valid = _inputs()
    got = _gathered(attention_probabilities(query, key, 0.3, valid, prefix=prefix, chunk_elements=chunk))
    want = _plain(query, key, 0.3, _causal(valid))
    assert (got - want).abs().max() < 1e-6
    plain = _gathered(attention_probabilities(query, key, 0.3, prefix=prefix, chunk_elements=chunk))
    assert (plain - _plain(query, key, 0.3, _causal())).abs().max() < 1e-6


def test_prefix_chunks_attend_only_the_keys_their_rows_may_see():
    query, key, _, _ = _inputs()
    widths = [(start, probs.shape[3], probs.shape[4])
              for start, probs in attention_probabilities(query, key, 0.3, prefix=True, chunk_elements=1)]
    assert widths == [(i, 1, K - q + i + 1) for i in range(q)]


@pytest.mark.parametrize("chunk", [1 << 20, 1])
def test_causal_by_original_positions(chunk):
    query, key, _, _ = _inputs()
    positions = torch.arange(K).repeat(B, Hkv, 1) * 2                   # positions 0, 2, 4, ... (gaps: evicted)
    positions[0, 1, :2] = -1                                              # padding
    qpos = torch.tensor([6, 7, 9, 12, 16])
    got = _gathered(attention_probabilities(query, key, 0.4, positions=(qpos, positions), chunk_elements=chunk))
    visible = (positions.unsqueeze(2) <= qpos.view(1, 1, q, 1)) & (positions.unsqueeze(2) >= 0)
    assert (got - _plain(query, key, 0.4, visible)).abs().max() < 1e-6


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("chunk", [1 << 20, 1])
def test_explicit_visibility_and_padding(per_head, chunk):
    query, key, _, valid = _inputs()
    window = _causal() & (torch.arange(K)[None, :] > torch.arange(q)[:, None] + (K - q) - 3)   # sliding window 3
    visible = window.clone() if per_head else window[0, 0]
    if per_head:
        visible[1, 0, :, 4] = False                                      # a head that dropped one key
    full = visible.expand(B, Hkv, q, K) & valid.unsqueeze(2)
    got = _gathered(attention_probabilities(query, key, 0.3, valid, visible=visible, chunk_elements=chunk))
    assert (got - _plain(query, key, 0.3, full)).abs().max() < 1e-6


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("chunk", [1 << 20, 1])
def test_softcap_and_sinks(eager, chunk):
    query, key, _, valid = _inputs()
    sinks = torch.linspace(-1.0, 2.0, H)
    for options in ({"softcap": 0.7}, {"sinks": sinks}, {"softcap": 0.7, "sinks": sinks}):
        got = _gathered(attention_probabilities(query, key, 0.3, valid, eager=eager, chunk_elements=chunk, **options))
        want = _plain(query, key, 0.3, _causal(valid), **options)
        assert (got - want).abs().max() < 1e-6, options
        assert (got - _plain(query, key, 0.3, _causal(valid))).abs().max() > 1e-3, options   # the option matters


def test_dtypes_of_the_softmax():
    query, key, _, _ = _inputs(torch.bfloat16)
    plain = next(attention_probabilities(query, key, 0.3))[1]
    assert plain.dtype == torch.float32                                  # logits and softmax in float32
    assert next(attention_probabilities(query, key, 0.3, eager=True))[1].dtype == torch.float32
    sinks = torch.zeros(H, dtype=torch.bfloat16)
    assert next(attention_probabilities(query, key, 0.3, eager=True, sinks=sinks))[1].dtype == torch.bfloat16
    wide = _inputs(torch.float64)
    assert next(attention_probabilities(wide[0], wide[1], 0.3, dtype=torch.float64))[1].dtype == torch.float64
    # Eager logits are taken in the model's dtype (as transformers computes them), so they differ from float32's.
    eager = _gathered(attention_probabilities(query, key, 0.3, eager=True))
    assert (eager - _gathered([(0, plain)])).abs().max() > 0
    assert (eager - _plain(query, key, 0.3, _causal())).abs().max() < 2e-2


@pytest.mark.parametrize("chunk", [1 << 20, 1])
def test_chunked_attention_equals_the_full_matrix_times_values(chunk):
    query, key, value, valid = _inputs()
    got = chunked_attention(query, key, value, 0.3, valid, softcap=0.9, chunk_elements=chunk)
    want = torch.matmul(_plain(query, key, 0.3, _causal(valid), softcap=0.9), value.double().repeat_interleave(G, 1))
    assert got.shape == (B, H, q, d) and (got - want).abs().max() < 1e-5


def test_prefix_chunks_refuse_another_mask():
    query, key, _, _ = _inputs()
    with pytest.raises(ValueError, match="prefix chunks need lower-right causality"):
        next(attention_probabilities(query, key, 0.3, prefix=True, visible=_causal()[0, 0]))
