"""pyramidkv: the layer pyramid equals the reference formula step by step; selection is SnapKV's vote."""

from __future__ import annotations

import pytest

from polykv.adapters.rules.pyramidkv import PyramidKVRule, pyramid_budgets
from polykv.adapters.rules.snapkv import SnapKVRule


def naive_pyramid(L, T, total, w, beta):
    """The reference's per-layer capacity (window included), then the excess trimmed from the largest layers."""
    M = total // L
    if T < M:
        return [min(T, M)] * L
    if T < 2 * (M - w) or L == 1:
        caps = [M] * L
    else:
        lo = (M - w) // beta
        hi = 2 * (M - w) - lo
        if hi >= T - w:
            hi = T - w
            lo = 2 * (M - w) - hi
        step = (hi - lo) // (L - 1)
        caps = []
        for layer in range(L):
            caps.append(min(T, hi - layer * step + w))
    while sum(caps) > total:
        big = max(caps)
        caps[caps.index(big)] -= 1
    return caps


@pytest.mark.parametrize("L,T,total,w,beta", [
    (4, 100, 4 * 40, 8, 20), (30, 2048, 30 * 256, 8, 20), (30, 2048, 30 * 512, 8, 20), (5, 50, 5 * 30, 8, 20),
    (3, 20, 3 * 30, 8, 20), (6, 300, 6 * 64, 4, 5), (1, 100, 40, 8, 20),
])
def test_pyramid_budgets_match_reference(L, T, total, w, beta):
    got = pyramid_budgets(L, T, total, window=w, beta=beta)
    assert got == naive_pyramid(L, T, total, w, beta)
    assert sum(got) <= total and all(1 <= c <= T for c in got)
    assert got == sorted(got, reverse=True)  # lower layers keep more


@pytest.mark.parametrize("capacity", [3, 9, 12])
def test_pyramidkv_selection_is_snapkv_with_reference_settings(make_ctx, capacity):
    ctx = make_ctx(T=20, w=8, gaps=True)
    got = PyramidKVRule().select(ctx, capacity)
    want = SnapKVRule(window=8, kernel_size=7, pooling="max").select(ctx, capacity)
    assert got.tolist() == want.tolist()
    assert PyramidKVRule.defaults == {"window": 8, "kernel_size": 7, "pooling": "max"}
