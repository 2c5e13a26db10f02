"""Every registered built-in rule x every phase it supports returns [B, Hkv, capacity] ascending unique indices."""

from __future__ import annotations

import pytest
import torch

from polykv.adapters.rules import RULES
from polykv.contract.rules import PHASES, SIGNALS, RetentionRule
from polykv.adapters.rules.kvzip_heads import HeadScores
from tests.adapters.rules.test_kvzap import random_surrogate
from polykv.adapters.rules.query_stats import QueryStats
from polykv.registry import Registry
from polykv.contract.probe import ProbeChunk
from polykv.contract.state import ATTENTION_INPUT, Observation
from polykv.contract.selection import as_selection

REGISTRY = Registry(load_entry_points=False)
KVZAP_WIDTH = 12
"""The hidden size of the attention inputs kvzap's random surrogate reads here."""
NAMES = REGISTRY.names("rule")
CASES = [(n, p) for n in NAMES for p in PHASES if p in REGISTRY.rule(n).phases]


def stats(L=1, H=4, d=8):
    g = torch.Generator().manual_seed(0)
    mu_r, mu_i = torch.randn(L, H, d // 2, generator=g), torch.randn(L, H, d // 2, generator=g)
    return QueryStats(mu_real=mu_r, mu_imag=mu_i, mean_abs=torch.complex(mu_r, mu_i).abs() + 0.5,
                      inv_freq=torch.tensor([100.0 ** (-2 * i / d) for i in range(d // 2)]))


def test_every_builtin_rule_is_registered_and_declared():
    assert sorted(r.name for r in RULES) == NAMES == sorted(
        ["full", "streamingllm", "h2o", "snapkv", "tova", "triattention", "random", "key-norm", "pyramidkv", "cake",
         "scissorhands", "adakv", "cam", "d2o",
         "expected-attention", "keydiff", "kvzip", "kvzip-head", "kvzap"])
    for rule in RULES:
        assert issubclass(rule, RetentionRule)
        assert rule.phases and rule.phases <= set(PHASES)
        assert rule.signal in SIGNALS
        assert rule.paper, f"{rule.name} must cite its paper"
        assert REGISTRY.entry("rule", rule.name).plugin == "polykv.adapters.rules"
        rule(**rule.defaults)  # every default is an accepted parameter


def observed_state(rule, ctx):
    """The rule's own state after observing the context's queries as the newest tokens of one forward."""
    state = rule.new_state()
    if state is not None and ATTENTION_INPUT in state.needs:  # it predicts from each token's attention input as it
        B, H, _, d = ctx.queries.shape  # arrives: one forward of the whole context (random inputs, random queries)
        g = torch.Generator().manual_seed(0)
        state.observe(Observation(layer_idx=ctx.layer_idx, phase=ctx.phase,
                                  query=torch.randn(B, H, ctx.num_stored, d, generator=g), keys=ctx.keys,
                                  positions=ctx.positions, valid=None, first_position=0, scaling=ctx.scaling,
                                  attention_input=torch.randn(B, ctx.num_stored, KVZAP_WIDTH, generator=g),
                                  model_data=ctx.model_data))
    elif state is not None:
        state.observe(Observation(layer_idx=ctx.layer_idx, phase=ctx.phase, query=ctx.queries, keys=ctx.keys,
                                  positions=ctx.positions, valid=None, first_position=int(ctx.query_positions[0]),
                                  scaling=ctx.scaling))
    if state is not None and state.observes_probe:  # a probe rule: one probe forward of the queries over every key
        T, w = ctx.num_stored, ctx.queries.shape[2]
        state.observe(Observation(layer_idx=ctx.layer_idx, phase="probe", query=ctx.queries,
                                  keys=torch.cat([ctx.keys, ctx.keys[:, :, T - w:]], dim=2),
                                  positions=ctx.positions, valid=None, first_position=T, scaling=ctx.scaling,
                                  probe=ProbeChunk(ids=torch.zeros(ctx.keys.shape[0], w, dtype=torch.long),
                                                   span=(0, T))))
    return state


@pytest.mark.parametrize("name,phase", CASES)
@pytest.mark.parametrize("capacity", [1, 7, 15])
def test_selection_shape_and_order(make_ctx, name, phase, capacity):
    rule = REGISTRY.rule(name)()
    ctx = make_ctx(B=2, H=4, Hkv=2, T=16, d=8, w=rule.query_window(rule.params) or 1, phase=phase, gaps=True,
                   model_data={"triattention": stats(), "kvzip-head": HeadScores(scores=torch.tensor([[0.2, 0.7]])),
                               "kvzap": random_surrogate(L=1, Hkv=2, D=KVZAP_WIDTH)},
                   rope_inv_freq=stats().inv_freq)
    if name == "full":
        with pytest.raises(ValueError, match="keeps every token"):
            rule.select(ctx, capacity)
        return
    ctx.state = observed_state(rule, ctx)
    sel = as_selection(rule.select(ctx, capacity))
    if sel.ragged:  # head-wise budgets: each head keeps its own count, the layer at most its budget
        assert int(sel.counts.sum(-1).max()) <= 2 * capacity
        for rows, counts in zip(sel.index, sel.counts):
            for row, c in zip(rows, counts):
                kept = row[len(row) - int(c):]
                assert bool((kept[1:] > kept[:-1]).all()) and 0 <= int(kept.min()) and int(kept.max()) < 16
        return
    idx = sel.index
    assert idx.shape == (2, 2, capacity) and idx.dtype == torch.int64
    assert bool((idx >= 0).all()) and bool((idx < 16).all())
    assert bool((idx[..., 1:] > idx[..., :-1]).all()), "indices must be strictly ascending (unique)"
    if rule.shared_across_heads:
        assert torch.equal(idx[:, 0], idx[:, 1])


PREFILL_ONLY = ("snapkv", "pyramidkv", "adakv", "kvzip", "kvzip-head")  # kvzip: its probe needs the prompt;
# kvzip-head: it ranks the prompt's heads once, through its allocator


def test_observation_window_rules_are_prefill_only():
    for name in PREFILL_ONLY:
        assert REGISTRY.rule(name).phases == frozenset({"prefill"})
    assert all(REGISTRY.rule(n).phases == frozenset(PHASES) for n in NAMES if n not in PREFILL_ONLY)
