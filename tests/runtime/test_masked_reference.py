"""Every rule in every phase equals a full-cache forward whose attention is masked to the retained tokens.

The run records, before every forward, the original positions each layer and KV head stores. The
reference then runs the whole sequence (prompt + every fed token) through the same model with no
cache and an eager attention whose mask lets each query row see exactly: the causal prompt for
prefill rows (prefill attends the raw prompt), and the stored positions plus the forward's own
causal new tokens for every later row. Logits must agree within 1e-4 at every step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import polykv
from polykv.plan import OpSpec
from polykv.profiling.query_stats import compute_query_stats

TOL = 1e-4
PROMPT, STEPS, QUESTION = 40, 12, 5
REF = "polykv_masked_reference"
_MASKS: dict[int, torch.Tensor] = {}

PARAMS = {"snapkv": {"window": 4, "kernel_size": 3}, "pyramidkv": {"window": 4, "kernel_size": 3},
          "cake": {"window": 4, "kernel_size": 3}, "scissorhands": {"history": 16, "recent": 2}}
PREFILL_RULES = ["streamingllm", "h2o", "snapkv", "tova", "triattention", "random", "key-norm", "pyramidkv", "cake",
                 "scissorhands"]
DECODE_RULES = ["streamingllm", "h2o", "tova", "triattention", "random", "key-norm", "cake", "scissorhands"]


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """Eager attention with a per-layer, per-KV-head mask [B, Hkv, N, N] from ``_MASKS``."""
    allowed = _MASKS[module.layer_idx]
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    logits = torch.matmul(query, k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed.repeat_interleave(G, 1), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF, _reference_attention)
AttentionMaskInterface.register(REF, lambda *a, **k: None)


@pytest.fixture(scope="module")
def stats(llama):
    model, _ = llama
    g = torch.Generator().manual_seed(7)
    return compute_query_stats(model, [torch.randint(1, 128, (1, 64), generator=g)])


def _run_and_record(model, plan, ids, question, stats):
    """Prefill ``ids``, feed ``question`` in one forward, then greedy steps; record stored positions."""
    records, logits, fed = [], [], [ids]
    with torch.no_grad(), polykv.apply(model, plan, model_data={"triattention": stats}) as session:
        cache = session.new_cache()
        out = model(ids, past_key_values=cache, use_cache=True)
        records.append((None, 0, ids.shape[1]))
        logits.append(out.logits)
        chunks = [question] + [None] * STEPS
        for chunk in chunks:
            if chunk is None:
                chunk = out.logits[:, -1:].argmax(-1)
            start = cache.get_seq_length()
            stored = [layer.positions.clone() for layer in cache.layers]
            out = model(chunk, past_key_values=cache, use_cache=True)
            for layer in cache.layers:  # capacity is honoured after every decode forward
                cap = layer.spec.plan.decode.resolve_capacity(cache.get_seq_length())
                if cap is not None:
                    assert layer.num_stored() <= cap + plan.trigger.decode_slack
            records.append((stored, start, start + chunk.shape[1]))
            logits.append(out.logits)
            fed.append(chunk)
    return torch.cat(fed, dim=1), torch.cat(logits, dim=1), records


def _reference(model, tokens, records, num_layers, kv_heads):
    B, N = tokens.shape
    rows = torch.arange(N)
    for layer in range(num_layers):
        allowed = torch.zeros(B, kv_heads, N, N, dtype=torch.bool)
        for stored, a, b in records:
            causal = (rows[a:b, None] >= rows[None, :]) & (rows[None, :] >= a)
            allowed[:, :, a:b] = causal if stored is None else causal | (rows[None, :] < a)
            if stored is not None:
                seen = torch.zeros(B, kv_heads, N, dtype=torch.bool)
                seen.scatter_(-1, stored[layer], True)
                allowed[:, :, a:b, :a] = seen[:, :, None, :a]
        _MASKS[layer] = allowed
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = REF
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        model.config._attn_implementation_internal = saved
        _MASKS.clear()


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
