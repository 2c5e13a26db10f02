"""Every rule in every phase equals a full-cache forward whose attention is masked to the retained tokens.

The run records, before every forward, the original positions each layer and KV head stores (heads
of a ragged layer store different numbers). The reference then runs the whole sequence (prompt +
every fed token) through the same model with no cache and an eager attention whose mask lets each
query row see exactly: the causal prompt for prefill rows (prefill attends the raw prompt), and the
stored positions plus the forward's own causal new tokens for every later row. Logits must agree
within 1e-4 at every step.

For merging rules the reference is the full cache with the merged values written in: the run also
records the stored K/V before every forward; stored tokens that received a merge use the recorded
(merged) K/V in the reference rows of that forward, and every other stored token's recorded K/V
must equal the full recompute's.
"""

from __future__ import annotations

import pytest
import attrs
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import polykv
from polykv.plan import OpSpec
from polykv.adapters.rules.query_stats import compute_query_stats
from polykv.runtime.cache import cache_keyword

TOL = 1e-4
PROMPT, STEPS, QUESTION = 40, 12, 5
REF = "polykv_masked_reference"
_MASKS: dict[int, torch.Tensor] = {}
_OVERRIDES: dict[int, list] = {}
_LAST_SPECS: list = []

PARAMS = {"snapkv": {"window": 4, "kernel_size": 3}, "pyramidkv": {"window": 4, "kernel_size": 3},
          "cake": {"window": 4, "kernel_size": 3}, "scissorhands": {"history": 16, "recent": 2}}
PREFILL_RULES = ["streamingllm", "h2o", "snapkv", "tova", "triattention", "random", "key-norm", "pyramidkv", "cake",
                 "scissorhands", "expected-attention", "keydiff"]
DECODE_RULES = ["streamingllm", "h2o", "tova", "triattention", "random", "key-norm", "cake", "scissorhands",
                "expected-attention", "keydiff"]


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """Eager attention with a per-layer, per-KV-head mask [B, Hkv, N, N] from ``_MASKS``; rows a:b of a
    forward whose stored K/V were merged attend the merged K/V (``_OVERRIDES``)."""
    allowed = _MASKS[module.layer_idx]
    G = query.shape[1] // key.shape[1]
    out = _masked(query, key, value, allowed, scaling, G)
    for a, b, where, k_over, v_over in _merge_overrides(module.layer_idx, key, value):
        k_b = torch.where(where.unsqueeze(-1), k_over, key)
        v_b = torch.where(where.unsqueeze(-1), v_over, value)
        out[:, :, a:b] = _masked(query[:, :, a:b], k_b, v_b, allowed[:, :, a:b], scaling, G)
    return out.transpose(1, 2).contiguous(), None


def _snapshot(view):
    return attrs.evolve(view, keys=view.keys.clone(), values=view.values.clone(), positions=view.positions.clone())


def _merge_overrides(layer, k_ref, v_ref):
    """(a, b, where [B, Hkv, N], K, V) per recorded forward: the recorded K/V of merged tokens; every other
    stored token's recorded K/V must equal the reference's own (``k_ref``, ``v_ref`` [B, Hkv, N, d])."""
    if layer not in _OVERRIDES:
        return []
    records, merged = _OVERRIDES[layer]
    B, Hkv, N, _ = k_ref.shape
    out = []
    for stored, a, b, views in records:
        if stored is None:
            continue
        view, pos = views[layer], stored[layer]
        where = torch.zeros(B, Hkv, N, dtype=torch.bool)
        k_over, v_over = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        for bb in range(B):
            for h in range(Hkv):
                for col, p in enumerate(pos[bb, h].tolist()):
                    if p < 0:
                        continue
                    if p in merged:
                        where[bb, h, p] = True
                        k_over[bb, h, p], v_over[bb, h, p] = view.keys[bb, h, col], view.values[bb, h, col]
                    else:  # an unmerged stored token is exactly the reference's
                        assert (view.values[bb, h, col] - v_ref[bb, h, p]).abs().max() < TOL
                        assert (view.keys[bb, h, col] - k_ref[bb, h, p]).abs().max() < TOL
        out.append((a, b, where, k_over, v_over))
    return out


def _masked(query, key, value, allowed, scaling, G):
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    logits = torch.matmul(query, k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed.repeat_interleave(G, 1), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v)


AttentionInterface.register(REF, _reference_attention)
AttentionMaskInterface.register(REF, lambda *a, **k: None)


@pytest.fixture(scope="module")
def stats(llama):
    model, _ = llama
    g = torch.Generator().manual_seed(7)
    return compute_query_stats(model, [torch.randint(1, 128, (1, 64), generator=g)])


def _run_and_record(model, plan, ids, question, stats, registry=None, merges=False, model_data=None):
    """Prefill ``ids``, feed ``question`` in one forward, then greedy steps; record stored positions
    (and, with ``merges``, the stored K/V views). ``model_data``: more per-model data than ``stats``."""
    records, logits, fed = [], [], [ids]
    with torch.no_grad(), polykv.apply(model, plan, model_data={"triattention": stats, **(model_data or {})},
                                       registry=registry) as session:
        _LAST_SPECS[:] = session.layer_specs
        cache = session.new_cache()
        out = model(ids, **{cache_keyword(model): cache}, use_cache=True)
        records.append((None, 0, ids.shape[1], None))
        logits.append(out.logits)
        chunks = [question] + [None] * STEPS
        for chunk in chunks:
            if chunk is None:
                chunk = out.logits[:, -1:].argmax(-1)
            start = cache.get_seq_length()
            stored = [layer.positions.clone() for layer in cache.layers]
            # copies: a 16-bit store's view is its buffer, which later appends and evictions overwrite in place
            views = [_snapshot(layer.storage.view()) for layer in cache.layers] if merges else None
            out = model(chunk, **{cache_keyword(model): cache}, use_cache=True)
            for layer in cache.layers:  # capacity is honoured after every decode forward
                cap = layer.spec.plan.decode.resolve_capacity(cache.get_seq_length())
                if cap is not None:  # per batch row, over the KV heads (heads may differ)
                    limit = (cap + plan.trigger.decode_slack) * layer.head_counts().shape[1]
                    assert bool((layer.head_counts().sum(-1) <= limit).all())
            records.append((stored, start, start + chunk.shape[1], views))
            logits.append(out.logits)
            fed.append(chunk)
        for layer in cache.layers:  # ragged layers hold exactly their tokens, per head
            counts = layer.head_counts()
            assert bool((counts == (layer.positions >= 0).sum(-1)).all())
    return torch.cat(fed, dim=1), torch.cat(logits, dim=1), records


def _reference(model, tokens, records, num_layers, kv_heads, merged=None):
    """Reference logits; ``merged[layer]`` = positions that ever received a merge (their recorded K/V
    are written into the reference, every other stored token's must equal the recompute)."""
    B, N = tokens.shape
    rows = torch.arange(N)
    for layer in range(num_layers):
        allowed = torch.zeros(B, kv_heads, N, N, dtype=torch.bool)
        for stored, a, b, *_ in records:
            causal = (rows[a:b, None] >= rows[None, :]) & (rows[None, :] >= a)
            allowed[:, :, a:b] = causal if stored is None else causal | (rows[None, :] < a)
            if stored is not None:
                seen = torch.zeros(B, kv_heads, N + 1, dtype=torch.bool)
                seen.scatter_(-1, stored[layer].masked_fill(stored[layer] < 0, N), True)  # padding -> spare slot
                allowed[:, :, a:b, :a] = seen[:, :, None, :a]
        _MASKS[layer] = allowed
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = REF
    try:
        with torch.no_grad():
            if merged is not None:
                _OVERRIDES.update({layer: (records, merged[layer]) for layer in range(num_layers)})
            return model(tokens).logits
    finally:
        model.config._attn_implementation_internal = saved
        _MASKS.clear()
        _OVERRIDES.clear()


def _cases():
    for rule in PREFILL_RULES:
        yield pytest.param("prefill", rule, 1, id=f"prefill-{rule}")
    for rule in DECODE_RULES:
        for slack in (1, 4):
            yield pytest.param("decode", rule, slack, id=f"decode-{rule}-slack{slack}")


@pytest.mark.parametrize("phase,rule,slack", list(_cases()))
def test_rule_equals_masked_full_cache(llama, prompt, stats, phase, rule, slack):
    model, geo = llama
    op = OpSpec(rule=rule, capacity=12 if phase == "prefill" else 24, params=PARAMS.get(rule, {}))
    plan = polykv.uniform_plan(geo, **{phase: op}, decode_slack=slack)
    ids, question = prompt(2, PROMPT, seed=1), prompt(2, QUESTION, seed=2)
    tokens, logits, records = _run_and_record(model, plan, ids, question, stats)
    # Compression really happened somewhere, so the check is not vacuous.
    assert any(r[0] is not None and r[0][0].shape[-1] < r[1] for r in records)
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - ref).abs().max().item() < TOL


def test_mixed_per_layer_plan_equals_masked_full_cache(llama, prompt, stats):
    model, geo = llama
    layers = [
        {"prefill": OpSpec(rule="snapkv", capacity=16, params=PARAMS["snapkv"]),
         "decode": OpSpec(rule="h2o", capacity_ratio=0.5)},
        {"prefill": OpSpec(rule="tova", capacity=10), "decode": OpSpec(rule="streamingllm", capacity=20)},
    ]
    plan = polykv.per_layer_plan(geo, layers, decode_slack=2)
    ids, question = prompt(1, PROMPT, seed=4), prompt(1, QUESTION, seed=5)
    tokens, logits, records = _run_and_record(model, plan, ids, question, stats)
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - ref).abs().max().item() < TOL


def _v2_registry():
    from tests.runtime.v2_plugins import registry_with_plugins

    return registry_with_plugins()


@pytest.mark.parametrize("phase,slack,then", [("prefill", 1, "h2o"), ("prefill", 2, "triattention"),
                                              ("prefill", 1, "tova"), ("decode", 1, None), ("decode", 3, None)])
def test_ragged_heads_equal_masked_full_cache(llama, prompt, stats, phase, slack, then):
    """A head-wise rule keeps a different number of tokens per KV head; storage holds exactly those, and a
    uniform decode rule (``then``) then evicts from the ragged layer."""
    model, geo = llama
    registry = _v2_registry()
    op = OpSpec(rule="test-headwise", capacity=12 if phase == "prefill" else 20)
    decode = OpSpec(rule=then, capacity=16) if phase == "prefill" else op
    plan = polykv.uniform_plan(geo, prefill=op if phase == "prefill" else None, decode=decode, decode_slack=slack)
    ids, question = prompt(2, PROMPT, seed=11), prompt(2, QUESTION, seed=12)
    tokens, logits, records = _run_and_record(model, plan, ids, question, stats, registry=registry)
    ragged = [r for r in records if r[0] is not None and bool((r[0][0] < 0).any())]
    assert ragged, "some forward must have attended a ragged layer"
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - ref).abs().max().item() < TOL


@pytest.mark.parametrize("phase,keys", [("prefill", False), ("decode", False), ("decode", True)])
def test_merges_equal_full_cache_with_merged_values(llama, prompt, stats, phase, keys):
    model, geo = llama
    registry = _v2_registry()
    op = OpSpec(rule="test-merge", capacity=12 if phase == "prefill" else 20, params={"keys": keys})
    plan = polykv.uniform_plan(geo, **{phase: op}, decode_slack=2)
    ids, question = prompt(1, PROMPT, seed=13), prompt(1, QUESTION, seed=14)
    tokens, logits, records = _run_and_record(model, plan, ids, question, stats, registry=registry, merges=True)
    # The rule logs the position of every token it merged into (the same on every head here).
    merged = [{int(p) for t in getattr(spec, f"{phase}_rule").targets_log for p in t.flatten().tolist()}
              for spec in _LAST_SPECS]
    assert all(merged), "every layer must have merged"
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads, merged=merged)
    assert (logits - ref).abs().max().item() < TOL
    # Merging changed the result: the same masks without the merged values do not match.
    plain = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - plain).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("rule,params", [("cam", {"rule": "h2o", "merge_window": 3}),
                                         ("d2o", {"n_sink": 2}), ("d2o", {"n_sink": 2, "variant": "paper"})])
def test_decode_merging_methods_equal_full_cache_with_merged_values(llama, prompt, stats, monkeypatch, rule, params):
    """CaM and D2O in decode: every unmerged stored token equals the reference's own K/V, and the rows
    attend exactly the stored tokens with the merged tokens' stored K/V written in."""
    from polykv.registry import get_registry

    cls = get_registry().rule(rule)
    logged: dict[int, set] = {}
    original = cls.select

    def logging_select(self, ctx, capacity):
        sel = original(self, ctx, capacity)
        m = sel.merge
        touched = m.weights.ne(0).any(-1, keepdim=True).expand_as(m.targets)
        pos = ctx.positions.gather(-1, m.targets.flatten(2)).view_as(m.targets)
        got = logged.setdefault(ctx.layer_idx, set())
        got.update(int(p) for p in pos[touched].tolist())
        if m.target_scale is not None:
            got.update(int(p) for p in ctx.positions[m.target_scale.ne(1)].tolist())
        return sel

    monkeypatch.setattr(cls, "select", logging_select)
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule=rule, capacity=20, params=params), decode_slack=2)
    ids, question = prompt(1, PROMPT, seed=13), prompt(1, QUESTION, seed=14)
    tokens, logits, records = _run_and_record(model, plan, ids, question, stats, merges=True)
    merged = [logged.get(i, set()) for i in range(geo.num_layers)]
    assert all(merged), "every layer must have merged"
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads, merged=merged)
    assert (logits - ref).abs().max().item() < TOL
    plain = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - plain).abs().max().item() > 10 * TOL
