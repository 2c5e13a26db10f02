"""scissorhands: unimportant counts and selection equal a loop-by-loop computation."""

from __future__ import annotations

import pytest
import torch

from polykv.adapters.rules.scissorhands import ScissorhandsRule


def naive_quantile(xs, q):
    """Linear-interpolation quantile (numpy/torch default)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def naive_counts(ctx, attn_row, history, threshold, quantile):
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    G = H // Hkv
    nq = ctx.queries.shape[2]
    rows = min(history, nq)
    counts = [[[0] * T for _ in range(Hkv)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            kv = h // G
            for i in range(nq - rows, nq):
                row = attn_row(ctx, b, h, i)
                p = int(ctx.query_positions[i])
                seen = [j for j in range(T) if int(ctx.positions[b, kv, j]) <= p]
                if threshold == "average":
                    thr = 1.0 / (p + 1)
                else:
                    thr = naive_quantile([row[j] for j in seen], quantile)
                for j in seen:
                    if row[j] < thr:
                        counts[b][kv][j] += 1
    return counts


@pytest.mark.parametrize("threshold", ["average", "quantile"])
@pytest.mark.parametrize("capacity,history,recent,gaps", [
    (8, 4, 2, False), (5, 3, 0, True), (10, 6, 3, True), (2, 4, 5, False),
])
def test_scissorhands_matches_definition(make_ctx, attn_row, top, threshold, capacity, history, recent, gaps):
    ctx = make_ctx(T=16, w=history, gaps=gaps)
    rule = ScissorhandsRule(history=history, recent=recent, threshold=threshold)
    counts = naive_counts(ctx, attn_row, history, threshold, 0.9)
    assert rule.counts(ctx).tolist() == counts
    T = 16
    want = [[top([-c for c in counts[b][kv]], capacity, forced=range(T - min(recent, capacity), T))
             for kv in range(2)] for b in range(2)]
    assert rule.select(ctx, capacity).tolist() == want


def test_scissorhands_counts_only_queries_that_see_the_token(make_ctx):
    ctx = make_ctx(T=10, w=4)  # positions 0..9, queries at 6..9
    counts = ScissorhandsRule(history=4).counts(ctx)
    # token 9 is seen by one query (itself): at most G = 2 events; token 0 by all four.
    assert int(counts[..., 9].max()) <= 2 and int(counts[..., 0].max()) <= 8


def test_scissorhands_rejects_bad_parameters_when_built():
    for bad, match in [({"history": 0}, "history"), ({"quantile": 1.0}, "quantile"),
                       ({"threshold": "median"}, "threshold"), ({"recent": -1}, "recent")]:
        with pytest.raises(ValueError, match=match):
            ScissorhandsRule(**bad)
