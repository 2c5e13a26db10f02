"""Cross-layer sharing (MiniCache): the merge against a loop-by-loop reference of the reference code's formula,
the runtime against a cache-free reference that attends the restored K/V, memory against the prediction, and
no sharing against today's path."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import polykv
from polykv.memory import predict_resident
from polykv.models.geometry import geometry_of_model
from polykv.profiling.capture import capture_sequence
from polykv.storage.layer_share import SharedStore, merge_pair, retained_count
from polykv.testing import tiny_model, token_ids

EPS = 1e-6


def loop_merge(lower: torch.Tensor, upper: torch.Tensor, t: float, ratio: float):
    """KVCache-Factory's compress/restore_minicache_pair, one (row, head, token) at a time in float64:
    returns the restored (lower, upper) and the retained indices per (row, head)."""
    B, H, T, d = lower.shape
    out_lo, out_hi = torch.empty(B, H, T, d, dtype=torch.float64), torch.empty(B, H, T, d, dtype=torch.float64)
    kept = {}
    for b in range(B):
        for h in range(H):
            angles = []
            for i in range(T):
                a = [float(v) for v in lower[b, h, i]]
                c = [float(v) for v in upper[b, h, i]]
                na = max(math.sqrt(sum(v * v for v in a)), EPS)
                nc = max(math.sqrt(sum(v * v for v in c)), EPS)
                ua, uc = [v / na for v in a], [v / nc for v in c]
                cos = min(max(sum(x * y for x, y in zip(ua, uc)), -1 + EPS), 1 - EPS)
                om = math.acos(cos)
                s = math.sin(om)
                if abs(s) > EPS:
                    e = [math.sin((1 - t) * om) / s * x + math.sin(t * om) / s * y for x, y in zip(ua, uc)]
                else:
                    e = [(1 - t) * x + t * y for x, y in zip(ua, uc)]
                ne = max(math.sqrt(sum(v * v for v in e)), EPS)
                e = [v / ne for v in e]
                ne = max(math.sqrt(sum(v * v for v in e)), EPS)   # restore renormalises once more
                out_lo[b, h, i] = torch.tensor([v / ne * na for v in e], dtype=torch.float64)
                out_hi[b, h, i] = torch.tensor([v / ne * nc for v in e], dtype=torch.float64)
                angles.append((om / math.pi, i))
            count = math.ceil(T * ratio)
            top = sorted(i for _, i in sorted(angles, reverse=True)[:count])
            for i in top:
                out_lo[b, h, i], out_hi[b, h, i] = lower[b, h, i].double(), upper[b, h, i].double()
            kept[b, h] = top
    return out_lo, out_hi, kept


@pytest.mark.parametrize("t,ratio", [(0.6, 0.05), (0.5, 0.2), (0.0, 0.0), (1.0, 1.0)])
def test_merge_and_restore_equal_the_loop_reference(t, ratio):
    g = torch.Generator().manual_seed(3)
    lower = torch.randn(2, 2, 23, 8, generator=g, dtype=torch.float64)
    upper = lower + 0.7 * torch.randn(2, 2, 23, 8, generator=g, dtype=torch.float64)
    upper[0, 1, 5] = -lower[0, 1, 5]          # opposite directions: the clamp, then the largest angle
    upper[1, 0, 7] = 3 * lower[1, 0, 7]       # the same direction: the lerp-free limit
    pair = merge_pair(lower, upper, interpolation=t, retention_ratio=ratio)
    ref_lo, ref_hi, kept = loop_merge(lower, upper, t, ratio)
    for b in range(2):
        for h in range(2):
            assert pair.index[b, h].tolist() == kept[b, h]
    torch.testing.assert_close(pair.restore(0), ref_lo, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(pair.restore(1), ref_hi, atol=1e-12, rtol=1e-10)
    R = retained_count(23, ratio)
    assert pair.direction.shape == (2, 2, 23 - R, 8) and pair.retained[0].shape == (2, 2, R, 8)


def test_identical_directions_restore_exactly():
    g = torch.Generator().manual_seed(0)
    lower = torch.randn(1, 3, 40, 16, generator=g)
    scale = torch.rand(1, 3, 40, 1, generator=g) + 0.5
    pair = merge_pair(lower, lower * scale, retention_ratio=0.0)
    torch.testing.assert_close(pair.restore(0), lower, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pair.restore(1), lower * scale, atol=1e-6, rtol=1e-5)


def test_retained_tokens_restore_bit_for_bit_and_the_count_is_known_in_advance():
    g = torch.Generator().manual_seed(1)
    lower, upper = torch.randn(1, 2, 41, 8, generator=g), torch.randn(1, 2, 41, 8, generator=g)
    pair = merge_pair(lower, upper)
    assert pair.index.shape[-1] == retained_count(41) == 3
    at = pair.index.unsqueeze(-1).expand(1, 2, 3, 8)
    assert torch.equal(pair.restore(0).gather(2, at), lower.gather(2, at))
    assert torch.equal(pair.restore(1).gather(2, at), upper.gather(2, at))


# -- the runtime -----------------------------------------------------------------------------------

PROMPT, STEPS = 40, 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=4, heads=4, kv_heads=2, head_dim=16)


def shared_plan(geo, **params):
    plan = polykv.full_plan(geo)
    return plan.with_layer(1, share=0, share_params=params).with_layer(3, share=2)


def _run(model, plan, prompt, steps):
    """Prefill, then ``steps`` greedy one-token forwards; every forward's logits [N, vocab] and the tokens fed."""
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        kw = {session.cache_keyword: cache}
        logits = [model(prompt, use_cache=True, **kw).logits[0]]
        fed = [prompt]
        for _ in range(steps):
            nxt = logits[-1][-1:].argmax(-1).view(1, 1)
            fed.append(nxt)
            logits.append(model(nxt, use_cache=True, **kw).logits[0])
        return torch.cat(logits), torch.cat(fed, dim=1), session, cache


_REF = "polykv_test_shared_reference"
_SWAP: dict[int, tuple] = {}


def _restored_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prompt rows attend the raw K/V causally (prefill attends the raw prompt); every later row attends the
    restored prompt K/V of its layer plus the raw K/V of the tokens after the prompt."""
    from polykv.attention.signals import chunked_attention

    T = PROMPT
    if scaling is None:
        scaling = module.scaling
    out = chunked_attention(query, key, value, scaling, eager=True)             # causal (B, H, N, d)
    swap = _SWAP.get(module.layer_idx)
    if swap is not None:
        k2, v2 = key.clone(), value.clone()
        k2[:, :, :T], v2[:, :, :T] = swap
        late = chunked_attention(query, k2, v2, scaling, eager=True)
        out[:, :, T:] = late[:, :, T:]
    return out.transpose(1, 2).contiguous(), None


def _reference_logits(model, tokens, pairs, t=0.6, ratio=0.05):
    """Cache-free logits of ``tokens`` where each pair's layers attend the loop reference's restored prompt K/V."""
    caps = capture_sequence(model, tokens[:, :PROMPT])
    _SWAP.clear()
    for lo, hi in pairs:
        k_lo, k_hi, _ = loop_merge(caps[lo].key, caps[hi].key, t, ratio)
        v_lo, v_hi, _ = loop_merge(caps[lo].value, caps[hi].value, t, ratio)
        _SWAP[lo] = (k_lo.float(), v_lo.float())
        _SWAP[hi] = (k_hi.float(), v_hi.float())
    AttentionInterface.register(_REF, _restored_attention)
    AttentionMaskInterface.register(_REF, lambda *a, **k: None)
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation_internal")}
    saved = [(c, c._attn_implementation_internal) for c in configs.values()]
    try:
        for c in configs.values():
            c._attn_implementation_internal = _REF
        with torch.no_grad():
            return model(tokens, use_cache=False).logits[0]
    finally:
        for c, impl in saved:
            c._attn_implementation_internal = impl
        _SWAP.clear()


def test_generation_under_a_shared_plan_equals_attention_on_the_restored_kv(model):
    geo = geometry_of_model(model)
    prompt = token_ids(1, PROMPT, seed=5)
    logits, tokens, _, cache = _run(model, shared_plan(geo), prompt, STEPS)
    assert [type(layer.key_store).__name__ for layer in cache.layers] == ["SharedStore"] * 4
    ref = _reference_logits(model, tokens, [(0, 1), (2, 3)])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    vanilla = _reference_logits(model, tokens, [])
    assert (logits[PROMPT:] - vanilla[PROMPT:]).abs().max() > 1e-3   # the merge changed something


def test_the_reference_only_swaps_what_it_should(model):
    """A sanity check of the reference itself: with no pairs it is the vanilla forward."""
    prompt = token_ids(1, PROMPT + 3, seed=6)
    with torch.no_grad():
        vanilla = model(prompt, use_cache=False).logits[0]
    torch.testing.assert_close(_reference_logits(model, prompt, []), vanilla, atol=1e-5, rtol=0)


def test_no_sharing_takes_todays_path_bit_for_bit(model):
    geo = geometry_of_model(model)
    prompt = token_ids(1, PROMPT, seed=7)
    plain = polykv.full_plan(geo)
    assert plain.to_json() == polykv.plan.writing.dumps(plain) and '"schema_version": 1' in plain.to_json()
    logits, _, _, cache = _run(model, plain, prompt, STEPS)
    assert not any(isinstance(layer.key_store, SharedStore) for layer in cache.layers)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=STEPS + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    vanilla = torch.cat([step[0:1] for step in out.logits])
    assert torch.equal(logits[PROMPT - 1:].argmax(-1), vanilla.argmax(-1))
    torch.testing.assert_close(logits[PROMPT - 1:], vanilla, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch,ratio", [(1, 0.05), (2, 0.25)])
def test_measured_bytes_equal_the_prediction_after_prefill_and_in_decode(model, batch, ratio):
    geo = geometry_of_model(model)
    plan = shared_plan(geo, retention_ratio=ratio)
    prompt = token_ids(batch, PROMPT, seed=8)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        kw = {session.cache_keyword: cache}
        model(prompt, use_cache=True, **kw)
        got = session.resident_bytes()
        rows = after_prefill = predict_resident(plan, geo, PROMPT, batch=batch, dtype_bytes=4)
        assert list(got.per_layer) == [r.resident_bytes for r in rows]
        assert [m.get("share_index", 0) for m in got.metadata_per_layer] == \
               [r.metadata.get("share_index", 0) for r in rows]
        for _ in range(3):
            model(token_ids(batch, 1, seed=9), use_cache=True, **kw)
        got = session.resident_bytes()
        rows = predict_resident(plan, geo, PROMPT, batch=batch, dtype_bytes=4, phase="decode", new_tokens=3)
        assert list(got.per_layer) == [r.resident_bytes for r in rows]
    full = predict_resident(polykv.full_plan(geo), geo, PROMPT, batch=batch, dtype_bytes=4)
    R = retained_count(PROMPT, ratio)
    per_stream = batch * 2 * 4 * ((PROMPT - R) * (16 + 2) + 2 * R * 16)   # directions once, 2 norms, 2 x retained
    assert rows[0].resident_bytes + rows[1].resident_bytes - 4 * batch * 2 * 16 * 16 * 4 == 2 * per_stream
    assert sum(r.resident_bytes for r in after_prefill[:2]) == 2 * per_stream < sum(r.resident_bytes for r in full[:2])


def test_chunked_prefill_and_a_fresh_cache_share_the_same_way(model):
    geo = geometry_of_model(model)
    plan = shared_plan(geo)
    prompt = token_ids(1, PROMPT, seed=10)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        one = session.prefill(prompt).logits[:, -1]
        views = [layer.storage.view().keys.clone() for layer in session.cache.layers]
        two = session.prefill(prompt, chunk_size=16).logits[:, -1]
        again = [layer.storage.view().keys for layer in session.cache.layers]
    torch.testing.assert_close(one, two, atol=1e-5, rtol=0)
    for a, b in zip(views, again):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_plan_show_prints_the_pairs_and_the_file_round_trips(tmp_path, model):
    from polykv.commands.plan import format_plan

    geo = geometry_of_model(model)
    plan = shared_plan(geo, interpolation=0.5)
    path = tmp_path / "shared.plan.json"
    plan.save(str(path))
    text = path.read_text()
    assert '"schema_version": 2' in text and '"share": 0' in text and '"share_params": {"interpolation": 0.5}' in text
    loaded = polykv.load_plan(str(path), geometry=geo)
    assert loaded.share_pairs() == [(0, 1), (2, 3)] and loaded.to_json() == plan.to_json()
    shown = format_plan(loaded, str(path), 512)
    assert "(schema 2, 4 layers)" in shown
    assert "0-1 (t=0.5, 26 of 512 tokens per head unmerged), 2-3 (t=0.6, 26 of 512" in shown
    assert shown.splitlines()[-1].split()[-1] == "2-3" and "SHARE" in shown
    assert "SHARE" not in format_plan(polykv.full_plan(geo), "p", 512)
