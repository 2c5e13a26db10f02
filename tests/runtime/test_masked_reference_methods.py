"""The methods with head-wise budgets, allocators and merges equal a masked full-cache reference.

As in ``test_masked_reference.py``: the run records, before every forward, the original positions
each layer and KV head stores (``-1`` padding of ragged layers ignored); the reference runs the whole
sequence through the same model with no cache and an eager attention masked per layer and KV head to
exactly those positions. For merging rules (CaM, D2O) the reference also replaces the prompt's keys /
values by merged ones that it computes itself: it records the prompt's post-RoPE queries, keys and
values from its own uncached forward, replays each layer's prefill rule on them (rule state fed the
same queries, generator seeded as the session seeds it) and applies the returned merge. Logits must
agree within 1e-4 at every step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import polykv
from polykv.contract.rules import SelectionContext
from polykv.plan import AllocationGroup, OpSpec
from polykv.models.reference import record_run
from polykv.registry import get_registry
from polykv.contract.state import AccumulatedAttention, Observation, QueryWindow
from polykv.runtime.cache import cache_keyword

TOL = 1e-4
PROMPT, STEPS, QUESTION = 40, 8, 5
REF = "polykv_masked_reference_methods"
_MASKS: dict[int, torch.Tensor] = {}
_OVERRIDE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_CAPTURE: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """Eager attention with a per-layer, per-KV-head mask; rows after the prompt see merged prompt K/V."""
    layer = module.layer_idx
    if _CAPTURE.get("on"):
        _CAPTURE[layer] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    N = key.shape[2]
    causal = torch.ones(N, N).tril().bool().view(1, 1, N, N).expand(1, key.shape[1], N, N)
    allowed = _MASKS.get(layer, causal)
    out = _masked(query, key, value, allowed, scaling)
    if layer in _OVERRIDE:  # prefill rows attended the raw prompt; later rows attend what was stored
        k_new, v_new = _OVERRIDE[layer]
        P = k_new.shape[2]
        key = torch.cat([k_new.to(key.dtype), key[:, :, P:]], dim=2)
        value = torch.cat([v_new.to(value.dtype), value[:, :, P:]], dim=2)
        out[:, :, P:] = _masked(query[:, :, P:], key, value, allowed[:, :, P:], scaling)
    return out.transpose(1, 2).contiguous(), None


def _masked(query, key, value, allowed, scaling):
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    logits = torch.matmul(query, k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed.repeat_interleave(G, 1), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v)


AttentionInterface.register(REF, _reference_attention)
AttentionMaskInterface.register(REF, lambda *a, **k: None)


def _eager(model, tokens):
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = REF
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        model.config._attn_implementation_internal = saved


def _reference(model, tokens, records, num_layers, kv_heads):
    B, N = tokens.shape
    rows = torch.arange(N)
    for layer in range(num_layers):
        allowed = torch.zeros(B, kv_heads, N, N, dtype=torch.bool)
        for stored, a, b in records:
            causal = (rows[a:b, None] >= rows[None, :]) & (rows[None, :] >= a)
            allowed[:, :, a:b] = causal if stored is None else causal | (rows[None, :] < a)
            if stored is not None:
                seen = torch.zeros(B, kv_heads, N + 1, dtype=torch.bool)
                pos = stored[layer].clone()
                pos[pos < 0] = N  # ragged padding: a column nobody sees
                seen.scatter_(-1, pos, True)
                allowed[:, :, a:b, :a] = seen[:, :, None, :a]
        _MASKS[layer] = allowed
    try:
        return _eager(model, tokens)
    finally:
        _MASKS.clear()
        _OVERRIDE.clear()


def _replay_prefill_merges(model, plan, ids):
    """Merged prompt K/V per layer, computed from the reference's own uncached forward of the prompt."""
    _CAPTURE.clear()
    _CAPTURE["on"] = True
    try:
        _eager(model, ids)
    finally:
        _CAPTURE.pop("on")
    captured = dict(_CAPTURE)
    _CAPTURE.clear()
    registry = get_registry()
    gen = torch.Generator().manual_seed(0)  # the session's seed, consumed layer after layer
    merged = 0
    for lp in plan.layers:
        q, k, v = captured[lp.layer]
        op = lp.prefill
        rule = registry.rule(op.rule)(**op.params)
        state = rule.new_state()
        B, Hkv, P, _ = k.shape
        pos = torch.arange(P).view(1, 1, P).expand(B, Hkv, P)
        state.observe(Observation(layer_idx=lp.layer, phase="prefill", query=q, keys=k, positions=pos, valid=None,
                                  first_position=0, scaling=model.model.layers[lp.layer].self_attn.scaling))
        window, acc = state.component(QueryWindow), state.component(AccumulatedAttention)
        ctx = SelectionContext(layer_idx=lp.layer, phase="prefill", keys=k, positions=pos, tokens_seen=P,
                               scaling=model.model.layers[lp.layer].self_attn.scaling, values=v,
                               queries=window.queries if window else None,
                               query_positions=window.positions if window else None,
                               accumulated=acc.sums if acc else None, generator=gen, state=state)
        sel = rule.select(ctx, op.resolve_capacity(P))
        k2 = sel.merge.apply(k)[0] if "key" in sel.merge.streams else k
        v2 = sel.merge.apply(v)[0] if "value" in sel.merge.streams else v
        _OVERRIDE[lp.layer] = (k2, v2)
        merged += int((sel.merge.weights != 0).sum())
    assert merged > 0, "no evicted token merged: the check would be vacuous"


def _check(model, geo, plan, *, batch=1, merges=False):
    ids, question = _prompt(batch, PROMPT, 1), _prompt(batch, QUESTION, 2)
    run = record_run(model, plan, ids, continuation=question, steps=STEPS)
    assert any(r[0] is not None and bool((r[0][0] >= 0).sum(-1).min() < r[1]) for r in run.forwards)
    if merges:
        _replay_prefill_merges(model, plan, ids)
    ref = _reference(model, run.tokens, run.forwards, geo.num_layers, geo.num_kv_heads)
    assert (run.logits - ref).abs().max().item() < TOL
    return run.allocations, run.head_counts


def _prompt(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, length), generator=g)


@pytest.mark.parametrize("decode", ["full", "h2o"])
def test_adakv_ragged_heads_equal_masked_full_cache(llama, decode):
    model, geo = llama
    pre = OpSpec(rule="adakv", capacity=14, params={"rule_params": {"window": 4, "kernel_size": 3}})
    dec = OpSpec(rule=decode, capacity=None if decode == "full" else 20)
    plan = polykv.uniform_plan(geo, prefill=pre, decode=dec, decode_slack=2)
    _, counts = _check(model, geo, plan)
    # The last decode eviction leaves per-head counts; after prefill they were ragged (checked below).
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        model(_prompt(1, PROMPT, 1), **{cache_keyword(model): cache}, use_cache=True)
        after = cache.head_counts()
    assert any(len(set(head)) > 1 for layer in after for head in layer), after
    assert all(sum(head) == 2 * 14 for layer in after for head in layer)


@pytest.mark.parametrize("rule,allocator,params,alloc_params", [
    ("pyramidkv", "pyramidkv", {"window": 4, "kernel_size": 3}, {"window": 4}),
    ("cake", "cake", {"window": 4, "kernel_size": 3}, {"window": 4}),
    ("h2o", "d2o", {}, {}),
])
def test_allocated_layers_equal_masked_full_cache(llama, rule, allocator, params, alloc_params):
    model, geo = llama
    op = OpSpec(rule=rule, capacity=12, params=params)
    dec = OpSpec(rule="cake", capacity=12, params=params) if rule == "cake" else OpSpec()
    plan = polykv.uniform_plan(geo, prefill=op, decode=dec, decode_slack=2)
    plan = plan.__class__(layers=plan.layers, model=plan.model, trigger=plan.trigger, provenance=plan.provenance,
                          allocation=(AllocationGroup(allocator=allocator, layers=tuple(range(geo.num_layers)),
                                                      params=alloc_params),))
    allocations, _ = _check(model, geo, plan)
    budgets = [allocations[i]["budget"] for i in range(geo.num_layers)]
    assert sum(budgets) <= 12 * geo.num_layers
    if allocator != "cake":  # the pyramid and D2O's softmax split always differ across layers here
        assert len(set(budgets)) > 1, budgets


@pytest.mark.parametrize("rule,params", [
    ("cam", {"rule": "h2o", "merge_window": 3}),
    ("cam", {"rule": "streamingllm", "rule_params": {"n_sink": 2}, "merge_window": 4, "divide_by": "m"}),
    ("d2o", {"n_sink": 2}),
    ("d2o", {"n_sink": 2, "variant": "paper"}),
])
def test_prefill_merges_equal_masked_full_cache_with_merged_prompt(llama, rule, params):
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule=rule, capacity=12, params=params))
    _check(model, geo, plan, merges=True)


@pytest.mark.parametrize("rule,params", [("scissorhands", {"history": 16, "recent": 2}), ("cam", {"rule": "h2o"}),
                                         ("d2o", {"n_sink": 2})])
def test_decode_rules_with_state_honour_capacity(llama, rule, params):
    """Decode-time merging and history state: capacity honoured at every step, logits finite."""
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule=rule, capacity=20, params=params), decode_slack=1)
    ids = _prompt(2, 24, 3)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert out.shape == (2, 36)
        assert all(n <= 21 for n in session.cache.stored_tokens())
        assert session.resident_bytes().metadata_total > 0


@pytest.mark.parametrize("rule,params", [("scissorhands", {"history": 20, "recent": 2}), ("d2o", {"n_sink": 2}),
                                         ("cam", {"rule": "h2o"}), ("adakv", {"rule_params": {"window": 4}})])
def test_state_and_ragged_bytes_equal_the_prediction(llama, rule, params):
    """Right after prefill the resident K/V and rule-state bytes equal the memory model's prediction."""
    from polykv.memory import predict_resident

    model, geo = llama
    op = OpSpec(rule=rule, capacity=16, params=params)
    decodes = "decode" in get_registry().rule(rule)(**params).phases
    plan = polykv.uniform_plan(geo, prefill=op, decode=op if decodes else OpSpec())
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        model(_prompt(1, 48, 4), **{cache_keyword(model): cache}, use_cache=True)
        got = session.resident_bytes()
        rows = predict_resident(plan, geo, 48, dtype_bytes=4, num_heads=4, head_counts=cache.head_counts())
    assert list(got.per_layer) == [r.resident_bytes for r in rows]
    assert [sum(m.values()) for m in got.metadata_per_layer] == [r.metadata_bytes for r in rows]
    assert got.metadata_total > 0
