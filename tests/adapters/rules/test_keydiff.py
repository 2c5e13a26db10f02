"""keydiff: scores equal a loop-by-loop computation of the definition, kept indices equal kvpress's
scoring on a tiny model, and the rule passes the contract checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import polykv
from polykv.adapters.rules.keydiff import KeyDiffRule
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.runtime.cache import cache_keyword
from polykv.plugin_checks import check_rule
from polykv.testing import tiny_model, token_ids


def naive_keydiff_scores(keys, valid=None):
    """Plain Python: per batch row and KV head, anchor = mean of unit keys over valid tokens,
    score[j] = -cos(k_j, anchor). Returns nested lists [B][Hkv][T] (None on padding)."""
    B, Hkv, T, d = keys.shape
    out = []
    for b in range(B):
        rows = []
        for h in range(Hkv):
            ks = [keys[b, h, j].tolist() for j in range(T)]
            real = [j for j in range(T) if valid is None or bool(valid[b, h, j])]
            anchor = [0.0] * d
            for j in real:
                norm = math.sqrt(sum(x * x for x in ks[j]))
                for i in range(d):
                    anchor[i] += ks[j][i] / norm / len(real)
            a_norm = math.sqrt(sum(x * x for x in anchor))
            row = []
            for j in range(T):
                if j not in real:
                    row.append(None)
                    continue
                k_norm = math.sqrt(sum(x * x for x in ks[j]))
                row.append(-sum(x * y for x, y in zip(ks[j], anchor)) / (k_norm * a_norm))
            rows.append(row)
        out.append(rows)
    return out


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("capacity", [1, 5, 11])
def test_scores_and_selection_equal_the_loop_reference(make_ctx, top, phase, gaps, capacity):
    ctx = make_ctx(B=2, H=4, Hkv=2, T=12, d=8, phase=phase, gaps=gaps, seed=3)
    # Keys of very different norms: a rule averaging raw keys instead of unit keys ranks differently.
    scale = torch.linspace(0.1, 10.0, 12).view(1, 1, 12, 1)
    ctx.keys = ctx.keys * scale
    rule = KeyDiffRule()
    want = naive_keydiff_scores(ctx.keys)
    got = rule.score(ctx)
    assert got.shape == (2, 2, 12) and got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-5)
    idx = rule.select(ctx, capacity)
    for b in range(2):
        for h in range(2):
            assert idx[b, h].tolist() == top(want[b][h], capacity)


def test_raw_key_mean_would_rank_differently(make_ctx):
    """The test above can fail: with keys of unequal norms the unit-key anchor and the raw-key anchor disagree."""
    ctx = make_ctx(B=1, H=2, Hkv=1, T=12, d=8, seed=3)
    keys = ctx.keys * torch.linspace(0.1, 10.0, 12).view(1, 1, 12, 1)
    unit_anchor = F.normalize(keys, dim=-1).mean(2, keepdim=True)
    raw_anchor = keys.mean(2, keepdim=True)
    a = (-F.cosine_similarity(keys, unit_anchor, dim=-1)).topk(4).indices.sort().values
    r = (-F.cosine_similarity(keys, raw_anchor, dim=-1)).topk(4).indices.sort().values
    assert not torch.equal(a, r)


def test_ragged_padding_takes_no_part_in_the_anchor(make_ctx):
    ctx = make_ctx(B=1, H=4, Hkv=2, T=10, d=8, seed=5)
    valid = torch.ones(1, 2, 10, dtype=torch.bool)
    valid[0, 1, :4] = False  # head 1 stores 6 tokens behind 4 padding columns
    ctx.keys[0, 1, :4] = 100.0  # padding content must not move the anchor
    ctx.positions[0, 1, :4] = -1
    ctx.valid = valid
    want = naive_keydiff_scores(ctx.keys, valid)
    got = KeyDiffRule().score(ctx)
    assert torch.allclose(got[0, 0], torch.tensor(want[0][0]), atol=1e-5)
    assert torch.allclose(got[0, 1, 4:], torch.tensor(want[0][1][4:]), atol=1e-5)
    sel = polykv.contract.as_selection(KeyDiffRule().select(ctx, 3))
    kept = sel.index[0, 1, -3:].tolist()
    assert min(kept) >= 4
    assert sorted(kept) == sorted(4 + j for j in sorted(range(6), key=lambda j: -want[0][1][4 + j])[:3])


def kvpress_keydiff_kept(keys: torch.Tensor, n_kept: int) -> torch.Tensor:
    """kvpress ``KeyDiffPress.score`` + ``ScorerPress.compress`` index choice, written out: [B, Hkv, n_kept] sorted."""
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    scores = -F.cosine_similarity(keys, anchor, dim=-1)
    return scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_keeps_what_kvpress_scoring_keeps_on_a_tiny_model(family):
    model = tiny_model(family, layers=3, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    ids = token_ids(2, 40, seed=4)
    capacity = 13
    with torch.no_grad():
        vanilla = model(ids, use_cache=True).past_key_values
        plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="keydiff", capacity=capacity))
        with polykv.apply(model, plan) as session:
            cache = session.new_cache()
            model(ids, **{cache_keyword(model): cache}, use_cache=True)
            for layer in range(geo.num_layers):
                want = kvpress_keydiff_kept(vanilla.layers[layer].keys.float(), capacity)
                got = cache.layers[layer].positions.sort(dim=-1).values
                assert torch.equal(got, want), f"layer {layer}"


def test_check_rule_passes():
    calls = check_rule(KeyDiffRule)
    assert calls["prefill"] > 0 and calls["decode"] > 0


def naive_blockwise(keys_bh, keep, block):
    """Plain Python BlockPress over one head's keys (list of T vectors): kept token indices, sorted."""
    kept = list(range(keep))
    for start in range(keep, len(keys_bh), block):
        current = kept + list(range(start, min(start + block, len(keys_bh))))
        sub = torch.tensor([keys_bh[j] for j in current]).view(1, 1, len(current), -1)
        scores = naive_keydiff_scores(sub)[0][0]
        best = sorted(range(len(current)), key=lambda i: -scores[i])[:keep]
        kept = [current[i] for i in best]
    return sorted(kept)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("capacity,block", [(3, 4), (5, 2), (4, 100), (6, 1)])
def test_block_wise_selection_equals_the_loop_reference(make_ctx, phase, capacity, block):
    ctx = make_ctx(B=2, H=4, Hkv=2, T=14, d=8, phase=phase, gaps=True, seed=11)
    idx = KeyDiffRule(block_size=block).select(ctx, capacity)
    for b in range(2):
        for h in range(2):
            want = naive_blockwise(ctx.keys[b, h].tolist(), capacity, block)
            assert idx[b, h].tolist() == want
    if block >= 14 - capacity:  # one block holding every token: the one-shot choice
        assert torch.equal(idx, KeyDiffRule().select(ctx, capacity))


def test_block_wise_choice_differs_from_one_shot(make_ctx):
    """The block test above can fail: on these keys the block-wise and one-shot choices differ."""
    ctx = make_ctx(B=2, H=4, Hkv=2, T=14, d=8, gaps=True, seed=11)
    assert not torch.equal(KeyDiffRule(block_size=2).select(ctx, 5), KeyDiffRule().select(ctx, 5))


def test_block_wise_on_ragged_storage_and_head_budgets(make_ctx):
    ctx = make_ctx(B=1, H=4, Hkv=2, T=12, d=8, seed=5)
    valid = torch.ones(1, 2, 12, dtype=torch.bool)
    valid[0, 1, :5] = False
    ctx.positions[0, 1, :5] = -1
    ctx.valid = valid
    ctx.head_capacity = torch.tensor([[4, 3]])
    sel = polykv.contract.as_selection(KeyDiffRule(block_size=3).select(ctx, 4))
    assert sel.counts.tolist() == [[4, 3]]
    assert sel.index[0, 0, -4:].tolist() == naive_blockwise(ctx.keys[0, 0].tolist(), 4, 3)
    assert sel.index[0, 1, -3:].tolist() == [5 + j for j in naive_blockwise(ctx.keys[0, 1, 5:].tolist(), 3, 3)]


def kvpress_block_keydiff_kept(keys: torch.Tensor, n_kept: int, block_size: int) -> torch.Tensor:
    """kvpress ``BlockPress(KeyDiffPress(), block_size)`` index choice, written out: [B, Hkv, n_kept] sorted."""
    B, H, k_len, d = keys.shape
    block_size = min(block_size, k_len)
    kept = torch.arange(n_kept).expand(B, H, -1)
    for i in range(n_kept, k_len, block_size):
        current = torch.cat([kept, torch.arange(i, min(i + block_size, k_len)).expand(B, H, -1)], dim=-1)
        sub = keys.gather(2, current.unsqueeze(-1).expand(-1, -1, -1, d))
        anchor = F.normalize(sub, p=2, dim=-1).mean(dim=2, keepdim=True)
        scores = -F.cosine_similarity(sub, anchor, dim=-1)
        kept = current.gather(-1, scores.topk(n_kept, dim=-1).indices)
    return kept.sort(dim=-1).values


def test_block_wise_prefill_keeps_what_kvpress_block_press_keeps_on_a_tiny_model():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    ids = token_ids(2, 50, seed=6)
    capacity, block = 11, 8
    with torch.no_grad():
        vanilla = model(ids, use_cache=True).past_key_values
        op = OpSpec(rule="keydiff", capacity=capacity, params={"block_size": block})
        with polykv.apply(model, polykv.uniform_plan(geo, prefill=op)) as session:
            cache = session.new_cache()
            model(ids, **{cache_keyword(model): cache}, use_cache=True)
            for layer in range(geo.num_layers):
                want = kvpress_block_keydiff_kept(vanilla.layers[layer].keys.float(), capacity, block)
                got = cache.layers[layer].positions.sort(dim=-1).values
                assert torch.equal(got, want), f"layer {layer}"
                assert not torch.equal(got, kvpress_keydiff_kept(vanilla.layers[layer].keys.float(), capacity))


def test_check_rule_passes_block_wise():
    calls = check_rule(KeyDiffRule, {"block_size": 8})
    assert calls["prefill"] > 0 and calls["decode"] > 0


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_block_wise_run_equals_the_masked_full_cache(phase):
    """The default keydiff runs in the registry-wide masked-reference test; the block-wise choice here."""
    from polykv.models.reference import masked_reference_logits, record_run

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    op = OpSpec(rule="keydiff", capacity=12 if phase == "prefill" else 24, params={"block_size": 4})
    plan = polykv.uniform_plan(geo, **{phase: op}, decode_slack=4)
    run = record_run(model, plan, token_ids(2, 40, seed=1), continuation=token_ids(2, 5, seed=2), steps=12)
    assert any(r[0] is not None and bool((r[0][0] >= 0).sum(-1).min() < r[1]) for r in run.forwards)
    assert (run.logits - masked_reference_logits(model, run)).abs().max().item() < 1e-4
