"""adakv: head budgets and per-head selection equal a loop-by-loop computation of the reference."""

from __future__ import annotations

import math

import pytest
import torch

from polykv.adapters.rules.adakv import AdaKVRule, head_budgets


def naive_budgets(scores, average, alpha, rounding):
    """scores: [Hkv][n] lists of one batch row."""
    Hkv, n = len(scores), len(scores[0])
    flat = [(scores[h][j], h, j) for h in range(Hkv) for j in range(n)]
    flat.sort(key=lambda t: (-t[0], t[1] * n + t[2]))
    won = [0] * Hkv
    for _, h, _ in flat[: Hkv * average]:
        won[h] += 1
    floor_cap = math.floor(alpha * average + 1e-9)
    raw = [(1 - alpha) * c + floor_cap for c in won]
    if rounding == "reference":
        return [min(n, int(torch.round(torch.tensor(x, dtype=torch.float64)))) for x in raw]
    base = [math.floor(x + 1e-9) for x in raw]
    short = Hkv * average - sum(base)
    order = sorted(range(Hkv), key=lambda h: (-(raw[h] - base[h]), h))
    for h in order[:short]:
        base[h] += 1
    return base


@pytest.mark.parametrize("rounding", ["exact", "reference"])
@pytest.mark.parametrize("Hkv,n,average,alpha,seed", [
    (2, 10, 4, 0.2, 0), (3, 12, 5, 0.2, 1), (4, 8, 3, 0.5, 2), (3, 9, 9, 0.2, 3), (2, 7, 0, 0.2, 4),
    (4, 16, 6, 0.0, 5), (4, 16, 6, 1.0, 6),
])
def test_head_budgets_match_reference(rounding, Hkv, n, average, alpha, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, Hkv, n, generator=g) ** 3  # skewed, as attention is
    got = head_budgets(scores, average, floor_alpha=alpha, rounding=rounding)
    for b in range(2):
        assert got[b].tolist() == naive_budgets(scores[b].tolist(), average, alpha, rounding)
    if rounding == "exact":
        assert got.sum(-1).tolist() == [Hkv * average] * 2


def test_head_budgets_reject_bad_input():
    with pytest.raises(ValueError, match="average"):
        head_budgets(torch.rand(1, 2, 5), 6)
    with pytest.raises(ValueError, match="floor_alpha"):
        head_budgets(torch.rand(1, 2, 5), 2, floor_alpha=1.5)


def naive_snapkv_scores(ctx, attn_row, w, kernel):
    """SnapKV's max-pooled window votes of the prefix, per (b, kv) head, by loops."""
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    G = H // Hkv
    nq = ctx.queries.shape[2]
    out = []
    for b in range(B):
        heads = []
        for kv in range(Hkv):
            n = T - w
            votes = [0.0] * n
            for g in range(G):
                for i in range(nq - w, nq):
                    row = attn_row(ctx, b, kv * G + g, i)
                    for j in range(n):
                        votes[j] += row[j] / G
            heads.append([max(votes[max(j - kernel // 2, 0): min(j + kernel // 2, n - 1) + 1]) for j in range(n)])
        out.append(heads)
    return out


@pytest.mark.parametrize("capacity,alpha,seed", [(8, 0.2, 0), (6, 0.5, 1), (11, 0.0, 2), (7, 1.0, 3)])
def test_adakv_around_snapkv_matches_definition(make_ctx, attn_row, top, capacity, alpha, seed):
    w, kernel, T = 3, 3, 16
    ctx = make_ctx(B=2, H=6, Hkv=3, T=T, w=w, seed=seed, gaps=True)
    rule = AdaKVRule(rule_params={"window": w, "kernel_size": kernel}, floor_alpha=alpha)
    sel = rule.select(ctx, capacity)
    scores = naive_snapkv_scores(ctx, attn_row, w, kernel)
    for b in range(2):
        budgets = naive_budgets(scores[b], capacity - w, alpha, "exact")
        assert sel.counts[b].tolist() == [c + w for c in budgets]
        assert int(sel.counts[b].sum()) == 3 * capacity  # the layer keeps exactly its budget
        for h in range(3):
            kept = sel.index[b, h, sel.index.shape[-1] - int(sel.counts[b, h]):].tolist()
            assert kept == sorted(top(scores[b][h], budgets[h]) + list(range(T - w, T)))


def test_adakv_counts_differ_per_head_on_skewed_scores(make_ctx):
    ctx = make_ctx(B=1, H=6, Hkv=3, T=40, w=4, seed=3)
    ctx.keys[0, 0] *= 4.0  # sharper attention in head 0
    sel = AdaKVRule(rule_params={"window": 4}).select(ctx, 12)
    assert len(set(sel.counts[0].tolist())) > 1 and int(sel.counts.sum()) == 36


def test_adakv_checks_its_inner_rule_when_built():
    with pytest.raises(ValueError, match="inner rule"):
        AdaKVRule(rule="nope")
    with pytest.raises(ValueError, match="window"):
        AdaKVRule(rule_params={"window": 0, "bogus": 1})
    with pytest.raises(ValueError, match="must name another"):
        AdaKVRule(rule="adakv")
