"""Shared fixtures for the retention-rule tests: small random selection contexts."""

from __future__ import annotations

import pytest
import torch

from polykv.contract.rules import SelectionContext


def _context(*, B=2, H=4, Hkv=2, T=12, d=8, w=4, phase="prefill", seed=0, gaps=False, layer_idx=0,
             model_data=None, rope_inv_freq=None):
    """A context with every signal filled: keys, values, positions, last ``w`` queries, accumulated sums.

    With ``gaps`` the stored positions are a sorted random subset of a longer history (as after
    earlier evictions), identical for every head, and the queries sit at the newest stored positions.
    """
    w = min(w, T)  # a prompt of T tokens has at most T queries
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, T, d, generator=g)
    if gaps:
        pos = torch.sort(torch.randperm(3 * T, generator=g)[:T]).values
        pos[-w:] = torch.arange(3 * T - w, 3 * T)  # the newest stored tokens are the last w queries
        pos = torch.sort(torch.unique(pos)).values
        assert pos.numel() == T
    else:
        pos = torch.arange(T)
    positions = pos.view(1, 1, T).expand(B, Hkv, T).clone()
    queries = torch.randn(B, H, w, d, generator=g)
    acc = torch.rand(B, Hkv, T, generator=g) * 5
    counts = torch.randint(1, 20, (B, Hkv, T), generator=g)
    values = torch.randn(B, Hkv, T, d, generator=g)  # drawn last: the draws above stay as they were
    return SelectionContext(
        layer_idx=layer_idx, phase=phase, keys=keys, positions=positions, tokens_seen=int(pos[-1]) + 1,
        scaling=d ** -0.5, queries=queries, query_positions=pos[-w:].clone(), accumulated=acc,
        query_counts=counts, generator=torch.Generator().manual_seed(seed + 1),
        model_data=model_data or {}, rope_inv_freq=rope_inv_freq, values=values,
    )


@pytest.fixture
def make_ctx():
    """Factory: ``make_ctx(B=, H=, Hkv=, T=, d=, w=, phase=, seed=, gaps=, rope_inv_freq=)`` -> SelectionContext."""
    return _context


def naive_top(scores, k, forced=()):
    """Plain-Python selection: every index in ``forced`` plus the best-scoring others (ties: earlier).

    ``scores`` is a list of floats; returns the sorted kept indices.
    """
    forced = list(dict.fromkeys(forced))[:k]
    rest = [j for j in range(len(scores)) if j not in forced]
    rest.sort(key=lambda j: (-scores[j], j))
    return sorted(forced + rest[: k - len(forced)])


@pytest.fixture
def top():
    return naive_top


def naive_attention_row(ctx, b, h, i):
    """Softmax probabilities of query i (of ctx.queries) of query head h over the stored keys, by hand.

    Plain Python floats; keys newer than the query (by original position) get probability 0.
    """
    import math

    G = ctx.queries.shape[1] // ctx.keys.shape[1]
    kv = h // G
    q = ctx.queries[b, h, i].tolist()
    qpos = int(ctx.query_positions[i])
    logits = []
    for j in range(ctx.keys.shape[2]):
        if int(ctx.positions[b, kv, j]) <= qpos:
            logits.append(sum(x * y for x, y in zip(q, ctx.keys[b, kv, j].tolist())) * ctx.scaling)
        else:
            logits.append(-math.inf)
    m = max(logits)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
    s = sum(e)
    return [x / s for x in e]


@pytest.fixture
def attn_row():
    """``attn_row(ctx, b, h, i)``: one attention row computed loop by loop (list of floats)."""
    return naive_attention_row
