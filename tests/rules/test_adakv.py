"""adakv: head budgets and per-head selection equal a loop-by-loop computation of the reference."""

from __future__ import annotations

import math

import pytest
import torch

from polykv.adapters.rules.adakv import head_budgets, ragged_top


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


def test_ragged_top_keeps_protected_and_each_heads_best(top):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 3, 14, generator=g)
    counts = torch.tensor([[2, 5, 0], [7, 1, 3]])
    got = ragged_top(scores, counts, 2, 3)
    for b in range(2):
        for h in range(3):
            cand = scores[b, h, 2:11].tolist()
            want = sorted([0, 1] + [2 + j for j in top(cand, int(counts[b, h]))] + [11, 12, 13])
            assert got[b][h].tolist() == want


def test_head_budgets_reject_bad_input():
    with pytest.raises(ValueError, match="average"):
        head_budgets(torch.rand(1, 2, 5), 6)
    with pytest.raises(ValueError, match="floor_alpha"):
        head_budgets(torch.rand(1, 2, 5), 2, floor_alpha=1.5)
