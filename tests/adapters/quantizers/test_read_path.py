"""The blockwise read path: attention straight from KIVI codes equals dequantize-then-attend.

Covers int2/int4/int8/16-bit keys and values in every mix, GQA (keys never repeated), several new
queries (lower-right causal), block sizes that cut through groups and the code/residual boundary,
stores after gathers (explicit group ids, promoted residual tokens) and ragged heads whose padding
holds nan and huge values that must never reach the output.
"""

import attrs
import pytest
import torch
import torch.nn.functional as F

from polykv.attention.online_softmax import blockwise_attention, token_blocks

BITS = [2, 4, 8, 16]


def _query(B, H, q, d, seed=5):
    return torch.randn(B, H, q, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k_bits", BITS)
@pytest.mark.parametrize("v_bits", BITS)
def test_read_equals_dequantize_bit_for_bit(k_bits, v_bits, cases):
    ks, vs = cases.filled_pair(k_bits, v_bits, T=45)
    for store in (ks, vs):
        view, dense = token_blocks(store), store.dequantize()
        assert view.padded_len == len(store) and view.lengths is None
        for a, b in ((0, 45), (0, 5), (3, 17), (30, 45), (39, 41), (44, 45)):
            assert torch.equal(view.read(a, b), dense[:, :, a:b]), (store, a, b)


@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 8), (8, 4), (2, 16), (16, 4), (16, 16)])
@pytest.mark.parametrize("G,q", [(1, 1), (3, 1), (3, 4)])
@pytest.mark.parametrize("block", [5, 16, 512])
@pytest.mark.parametrize("T", [45, 48])  # 48: no key residual left
def test_blockwise_equals_dense_sdpa(k_bits, v_bits, G, q, block, T, cases):
    ks, vs = cases.filled_pair(k_bits, v_bits, T=T)
    query = _query(2, 2 * G, q, 16)
    got = blockwise_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.25, block_size=block)
    K, V = ks.dequantize(), vs.dequantize()
    mask = torch.ones(q, T, dtype=torch.bool).tril(T - q)  # lower-right causal
    want = F.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert got.shape == want.shape and got.dtype == query.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("k_bits,v_bits", [(2, 4), (4, 4), (8, 2)])
def test_blockwise_after_gathers(k_bits, v_bits, cases):
    """Explicit group ids and residual tokens promoted by per-head gathers are read like dequantize()."""
    ks, vs = cases.filled_pair(k_bits, v_bits, T=45)
    for seed, k in ((1, 30), (2, 21)):
        idx = cases.random_index(2, 2, len(ks), k, seed=seed)
        ks.gather(idx)
        vs.gather(idx)
        more = torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(seed))
        ks.append(more)
        vs.append(more * 0.5)
    assert ks.group_ids is not None
    for store in (ks, vs):
        assert torch.equal(token_blocks(store).read(0, len(store)), store.dequantize())
    query = _query(1 * 2, 4, 1, 16)
    got = blockwise_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.3, block_size=6)
    want = F.scaled_dot_product_attention(query, ks.dequantize(), vs.dequantize(), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 8), (16, 4), (16, 16)])
@pytest.mark.parametrize("q", [1, 3])
def test_ragged_heads_never_attend_padding(k_bits, v_bits, q, cases):
    """Heads of a layer hold different token counts; padding (nan, 1e30, code 255) never shows."""
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=3, T=45)
    kv, vv = token_blocks(ks), token_blocks(vs)
    lengths = torch.tensor([[45, 20, 3], [q, 33, 41]])
    kv = cases.poison(kv, *cases.ragged_counts(kv, lengths, seed=1))
    vv = cases.poison(vv, *cases.ragged_counts(vv, lengths, seed=2))
    assert torch.equal(kv.lengths, lengths) and kv.padded_len == 45
    query = _query(2, 6, q, 16)
    for block in (4, 64):
        got = blockwise_attention(query, kv, vv, scaling=0.25, block_size=block)
        assert bool(torch.isfinite(got).all())
        want = cases.dense_oracle(query, kv, vv, 0.25)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_ragged_matches_per_head_stores(cases):
    """A ragged view equals attending each head's own (shorter) store: dropped tokens do not exist."""
    ks, vs = cases.filled_pair(4, 2, B=1, Hkv=2, T=40)
    kv, vv = token_blocks(ks), token_blocks(vs)
    lengths = torch.tensor([[40, 25]])
    kv = cases.poison(kv, *cases.ragged_counts(kv, lengths, seed=3))
    vv = cases.poison(vv, *cases.ragged_counts(vv, lengths, seed=4))
    query = _query(1, 4, 1, 16)
    got = blockwise_attention(query, kv, vv, scaling=0.25, block_size=8)
    for h, L in enumerate((40, 25)):
        k = kv.dense()[:, h:h + 1, :L]
        v = vv.dense()[:, h:h + 1, :L]
        want = F.scaled_dot_product_attention(query[:, 2 * h:2 * h + 2], k, v, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(got[:, 2 * h:2 * h + 2], want, atol=2e-6, rtol=1e-5)


def test_bfloat16_stores_match_dense_within_bf16_rounding(cases):
    ks, vs = cases.filled_pair(4, 4, T=45, dtype=torch.bfloat16)
    query = _query(2, 4, 1, 16).to(torch.bfloat16)
    got = blockwise_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.25, block_size=8)
    want = F.scaled_dot_product_attention(query.float(), ks.dequantize().float(), vs.dequantize().float(),
                                          scale=0.25, enable_gqa=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_bad_inputs_get_clear_errors(cases):
    ks, vs = cases.filled_pair(4, 4, T=20)
    kv, vv = token_blocks(ks), token_blocks(vs)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        blockwise_attention(_query(2, 3, 1, 16), kv, vv, scaling=1.0)
    short = attrs.evolve(vv, residual=vv.residual[:, :, :-1])
    with pytest.raises(ValueError, match="values hold"):
        blockwise_attention(_query(2, 4, 1, 16), kv, short, scaling=1.0)
    lengths = torch.tensor([[20, 2], [20, 20]])
    kr = cases.poison(kv, *cases.ragged_counts(kv, lengths, seed=1))
    vr = cases.poison(vv, *cases.ragged_counts(vv, lengths, seed=1))
    with pytest.raises(ValueError, match="per-head lengths must lie"):
        blockwise_attention(_query(2, 4, 3, 16), kr, vr, scaling=1.0)
    with pytest.raises(ValueError, match="disagree on the per-head lengths"):
        blockwise_attention(_query(2, 4, 1, 16), kr, vv, scaling=1.0)
    with pytest.raises(ValueError, match="quantized_len must be"):
        attrs.evolve(kv, quantized_len=torch.full((2, 2), 99))


def test_per_head_stores_attend_their_own_tokens(cases):
    """Ragged storage that keeps one store pair per (batch row, KV head): each head sees only its tokens."""
    from polykv.attention.online_softmax import per_head_attention

    lengths = [[45, 20], [7, 33]]
    pairs, dense = [], []
    for b in range(2):
        for h in range(2):
            ks, vs = cases.filled_pair(4, 2, B=1, Hkv=1, T=lengths[b][h], seed=10 * b + h)
            pairs.append((token_blocks(ks), token_blocks(vs)))
            dense.append((ks.dequantize(), vs.dequantize()))
    query = _query(2, 6, 2, 16)
    got = per_head_attention(query, pairs, scaling=0.25, block_size=8)
    for i, (K, V) in enumerate(dense):
        b, h = divmod(i, 2)
        L = K.shape[2]
        mask = torch.ones(2, L, dtype=torch.bool).tril(L - 2)
        want = F.scaled_dot_product_attention(query[b:b + 1, 3 * h:3 * h + 3], K, V, attn_mask=mask, scale=0.25,
                                              enable_gqa=True)
        torch.testing.assert_close(got[b:b + 1, 3 * h:3 * h + 3], want, atol=2e-6, rtol=1e-5)
