"""full, streamingllm, key-norm, random, h2o: kept indices equal a direct computation of each definition."""

from __future__ import annotations

import math

import pytest
import torch

from polykv.adapters.rules.full import FullRule
from polykv.adapters.rules.h2o import H2ORule
from polykv.adapters.rules.key_norm import KeyNormRule
from polykv.adapters.rules.random_rule import RandomRule
from polykv.adapters.rules.streamingllm import StreamingLLMRule


def test_full_refuses_to_evict(make_ctx):
    ctx = make_ctx()
    with pytest.raises(ValueError, match="layer 0.*'full' keeps every token.*capacity 5"):
        FullRule().select(ctx, 5)


@pytest.mark.parametrize("n_sink,capacity", [(4, 8), (4, 1), (4, 4), (4, 3), (4, 11), (0, 5), (20, 6)])
def test_streamingllm_keeps_sinks_and_recent(make_ctx, n_sink, capacity):
    ctx = make_ctx(T=12)
    got = StreamingLLMRule(n_sink=n_sink).select(ctx, capacity)
    sinks = list(range(min(n_sink, capacity)))
    n_recent = capacity - len(sinks)
    expect = sorted(sinks + list(range(12 - n_recent, 12)))
    assert got.shape == (2, 2, capacity)
    for b in range(2):
        for h in range(2):
            assert got[b, h].tolist() == expect


@pytest.mark.parametrize("capacity", [1, 5, 11])
def test_key_norm_keeps_smallest_norms(make_ctx, top, capacity):
    ctx = make_ctx(T=12)
    got = KeyNormRule().select(ctx, capacity)
    for b in range(2):
        for h in range(2):
            norms = [math.sqrt(sum(float(x) ** 2 for x in ctx.keys[b, h, t])) for t in range(12)]
            assert got[b, h].tolist() == top([-n for n in norms], capacity)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("capacity,ratio", [(1, 0.5), (6, 0.5), (11, 0.5), (6, 0.0), (6, 1.0), (7, 0.3)])
def test_h2o_heavy_plus_recent(make_ctx, top, capacity, ratio, normalize):
    ctx = make_ctx(T=12)
    got = H2ORule(recent_ratio=ratio, normalize=normalize).select(ctx, capacity)
    recent = int(ratio * capacity)
    for b in range(2):
        for h in range(2):
            acc = ctx.accumulated[b, h].tolist()
            cnt = ctx.query_counts[b, h].tolist()
            score = [a / c for a, c in zip(acc, cnt)] if normalize else acc
            assert got[b, h].tolist() == top(score, capacity, forced=range(12 - recent, 12))


def test_h2o_missing_signal_is_an_error(make_ctx):
    ctx = make_ctx()
    ctx.accumulated = None
    with pytest.raises(ValueError, match="layer 0.*accumulated"):
        H2ORule().select(ctx, 4)
    ctx = make_ctx()
    ctx.query_counts = None
    with pytest.raises(ValueError, match="query_counts"):
        H2ORule(normalize=True).select(ctx, 4)


def test_random_is_seeded_per_head_and_uniform(make_ctx):
    ctx = make_ctx(T=12)
    rule = RandomRule()
    a = rule.select(ctx, 4)
    ctx.generator = torch.Generator().manual_seed(1)
    b = rule.select(ctx, 4)
    assert torch.equal(a, b), "the same seed must give the same selection"
    # Independent per KV head: over many draws, heads differ and inclusion frequencies are ~ C/T.
    ctx.generator = torch.Generator().manual_seed(123)
    counts = torch.zeros(12)
    differ = 0
    draws = 1500
    for _ in range(draws):
        idx = rule.select(ctx, 4)
        counts += torch.bincount(idx[0, 0], minlength=12).float()
        differ += int(not torch.equal(idx[0, 0], idx[0, 1]))
    freq = counts / draws
    assert torch.all((freq - 4 / 12).abs() < 0.05), freq
    assert differ > draws * 0.9


def test_random_without_generator_is_an_error(make_ctx):
    ctx = make_ctx()
    ctx.generator = None
    with pytest.raises(ValueError, match="seeded torch.Generator"):
        RandomRule().select(ctx, 3)


def test_unknown_parameter_is_an_error():
    with pytest.raises(ValueError, match="no parameter"):
        StreamingLLMRule(n_sinks=4)
