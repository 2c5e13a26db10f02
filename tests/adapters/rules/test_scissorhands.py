"""scissorhands: unimportant counts and selection equal a loop-by-loop computation."""

from __future__ import annotations

import pytest
import torch

from polykv.adapters.rules.scissorhands import ScissorhandsRule
from polykv.contract.rules import SelectionContext
from polykv.contract.state import Observation
from polykv.contract.selection import Selection


def observe_window(rule, ctx):
    """A fresh state that observed the context's queries as the newest tokens of one forward."""
    state = rule.new_state()
    q = ctx.queries.shape[2]
    state.observe(Observation(layer_idx=0, phase="prefill", query=ctx.queries, keys=ctx.keys,
                              positions=ctx.positions, valid=None, first_position=int(ctx.query_positions[0]),
                              scaling=ctx.scaling))
    assert q == ctx.queries.shape[2]
    ctx.state = state
    return state


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
    assert observe_window(rule, ctx).counts().tolist() == counts
    T = 16
    want = [[top([-c for c in counts[b][kv]], capacity, forced=range(T - min(recent, capacity), T))
             for kv in range(2)] for b in range(2)]
    assert rule.select(ctx, capacity).tolist() == want


def test_scissorhands_counts_only_queries_that_see_the_token(make_ctx):
    ctx = make_ctx(T=10, w=4)  # positions 0..9, queries at 6..9
    counts = observe_window(ScissorhandsRule(history=4), ctx).counts()
    # token 9 is seen by one query (itself): at most G = 2 events; token 0 by all four.
    assert int(counts[..., 9].max()) <= 2 and int(counts[..., 0].max()) <= 8


def test_scissorhands_rejects_bad_parameters_when_built():
    for bad, match in [({"history": 0}, "history"), ({"quantile": 1.0}, "quantile"),
                       ({"threshold": "median"}, "threshold"), ({"recent": -1}, "recent")]:
        with pytest.raises(ValueError, match=match):
            ScissorhandsRule(**bad)


def test_scissorhands_state_follows_tokens_through_decode_steps():
    """Rows are counted as they were computed (over the cache of their step) and follow evictions."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, d, history = 1, 4, 2, 8, 3
    rule = ScissorhandsRule(history=history, recent=1)
    state = rule.new_state()
    keys = torch.randn(B, Hkv, 6, d, generator=g)
    pos = torch.arange(6).view(1, 1, 6).expand(B, Hkv, 6)
    rows = []  # (query position, {token position: [events per kv head]}) in order

    def step(query, keys, pos, first):
        state.observe(Observation(layer_idx=0, phase="decode", query=query, keys=keys, positions=pos, valid=None,
                                  first_position=first, scaling=d ** -0.5))
        for i in range(query.shape[2]):
            p = first + i
            ev = {}
            for h in range(H):
                kv = h // (H // Hkv)
                logits = [float(query[0, h, i] @ keys[0, kv, j]) * d ** -0.5 if int(pos[0, kv, j]) <= p
                          else None for j in range(keys.shape[2])]
                m = max(x for x in logits if x is not None)
                z = sum(torch.tensor(x - m).exp().item() for x in logits if x is not None)
                for j, x in enumerate(logits):
                    if x is not None and torch.tensor(x - m).exp().item() / z < 1 / (p + 1):
                        ev.setdefault(int(pos[0, kv, j]), [0] * Hkv)[kv] += 1
            rows.append(ev)

    step(torch.randn(B, H, 6, d, generator=g), keys, pos, 0)
    for t in range(6, 12):
        keys = torch.cat([keys, torch.randn(B, Hkv, 1, d, generator=g)], dim=2)
        pos = torch.cat([pos, torch.full((B, Hkv, 1), t)], dim=2)
        step(torch.randn(B, H, 1, d, generator=g), keys, pos, t)
        if keys.shape[2] > 5:  # evict back to 4 by the rule itself
            ctx = SelectionContext(layer_idx=0, phase="decode", keys=keys, positions=pos, tokens_seen=t + 1,
                                   scaling=d ** -0.5, state=state)
            want_counts = [[sum(r.get(int(pos[0, kv, j]), [0] * Hkv)[kv] for r in rows[-history:])
                            for j in range(keys.shape[2])] for kv in range(Hkv)]
            assert state.counts()[0].tolist() == want_counts
            idx = rule.select(ctx, 4)
            state.gather(Selection(index=idx))
            keys = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, d))
            pos = pos.gather(2, idx)
