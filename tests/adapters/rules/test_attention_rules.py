"""snapkv and tova: kept indices equal a loop-by-loop computation of softmax attention and the rule."""

from __future__ import annotations

import math

import pytest

from polykv.adapters.rules.snapkv import SnapKVRule
from polykv.adapters.rules.tova import TOVARule


def attention_row(ctx, b, h, i):
    """Softmax probabilities of query i (of ctx.queries) of query head h over the stored keys, by hand."""
    G = ctx.queries.shape[1] // ctx.keys.shape[1]
    kv = h // G
    q = ctx.queries[b, h, i].tolist()
    qpos = int(ctx.query_positions[i])
    T = ctx.keys.shape[2]
    logits = []
    for j in range(T):
        if int(ctx.positions[b, kv, j]) <= qpos:
            k = ctx.keys[b, kv, j].tolist()
            logits.append(sum(a * c for a, c in zip(q, k)) * ctx.scaling)
        else:
            logits.append(-math.inf)
    m = max(logits)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
    s = sum(e)
    return [x / s for x in e]


def naive_snapkv(ctx, capacity, window, kernel, pooling, top):
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    G = H // Hkv
    w = min(window, T)
    nq = ctx.queries.shape[2]
    out = []
    for b in range(B):
        per_head = []
        for kv in range(Hkv):
            if capacity <= w:
                per_head.append(list(range(T - capacity, T)))
                continue
            n = T - w
            votes = [0.0] * n
            for g in range(G):
                for i in range(nq - w, nq):
                    row = attention_row(ctx, b, kv * G + g, i)
                    for j in range(n):
                        votes[j] += row[j] / G
            pooled = []
            for j in range(n):
                lo, hi = j - kernel // 2, j + kernel // 2
                inside = [votes[x] for x in range(max(lo, 0), min(hi, n - 1) + 1)]
                pooled.append(max(inside) if pooling == "max" else sum(inside) / kernel)
            per_head.append(sorted(top(pooled, capacity - w) + list(range(n, T))))
        out.append(per_head)
    return out


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("capacity,window,kernel,gaps", [
    (8, 4, 3, False), (5, 4, 3, True), (11, 4, 7, False), (1, 4, 3, False), (3, 4, 3, True),
    (4, 4, 5, False), (9, 2, 1, True),
])
def test_snapkv_matches_definition(make_ctx, top, pooling, capacity, window, kernel, gaps):
    ctx = make_ctx(T=16, w=window, gaps=gaps)
    got = SnapKVRule(window=window, kernel_size=kernel, pooling=pooling).select(ctx, capacity)
    assert got.tolist() == naive_snapkv(ctx, capacity, window, kernel, pooling, top)


def test_snapkv_window_larger_than_capacity_keeps_the_last_tokens(make_ctx):
    ctx = make_ctx(T=16, w=32)
    got = SnapKVRule().select(ctx, 6)  # default window 32 > T and > capacity
    assert all(row == list(range(10, 16)) for head in got.tolist() for row in head)


def test_snapkv_rejects_bad_parameters(make_ctx):
    ctx = make_ctx(T=16, w=4)
    with pytest.raises(ValueError, match="odd"):
        SnapKVRule(window=4, kernel_size=4).select(ctx, 8)
    with pytest.raises(ValueError, match="pooling"):
        SnapKVRule(window=4, pooling="sum").select(ctx, 8)
    with pytest.raises(ValueError, match="only 4 queries"):
        SnapKVRule(window=8).select(ctx, 10)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("capacity,gaps", [(1, False), (6, True), (11, False), (15, True)])
def test_tova_matches_definition(make_ctx, top, phase, capacity, gaps):
    ctx = make_ctx(T=16, w=1, phase=phase, gaps=gaps)
    got = TOVARule().select(ctx, capacity)
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    for b in range(B):
        rows = [attention_row(ctx, b, h, 0) for h in range(H)]
        mean = [sum(r[j] for r in rows) / H for j in range(T)]
        expect = top(mean, capacity)
        for kv in range(Hkv):
            assert got[b, kv].tolist() == expect


def test_tova_uses_only_the_newest_query(make_ctx, top):
    ctx = make_ctx(T=16, w=4)  # the runtime may hand over more rows; TOVA reads the last one
    got = TOVARule().select(ctx, 5)
    H = ctx.queries.shape[1]
    rows = [attention_row(ctx, 0, h, 3) for h in range(H)]
    assert got[0, 0].tolist() == top([sum(r[j] for r in rows) / H for j in range(16)], 5)
