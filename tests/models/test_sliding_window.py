"""Sliding-window layers under a plan: exact across the window boundary, bounded by their own window.

A tiny Gemma 3 text model (sliding, sliding, full: the hybrid layout of Gemma 3 in miniature) with a
window of 8 tokens; prompts of 30 tokens and decoding well past the window.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
import transformers

import polykv
import polykv.errors
import polykv.solvers
from polykv.models.geometry import FULL, SLIDING, geometry_of_model
from polykv.memory import memory_report, nominal_bytes
from polykv.plan import OpSpec
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, moend_configs
from polykv.models.reference import masked_reference_logits, record_run
from polykv.storage.token_buffer import layer_hold, reserve_tokens
from polykv.testing import chunked_prefill_against_vanilla, full_plan_against_vanilla, random_model, token_ids
from polykv.runtime.cache import cache_keyword

TOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def gemma3():
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=WINDOW,
        layer_types=[SLIDING, SLIDING, FULL], pad_token_id=0)
    model = random_model(cfg)
    return model, geometry_of_model(model)


def test_geometry_records_attention_type_and_window(gemma3):
    _, geo = gemma3
    assert geo.layer_types == (SLIDING, SLIDING, FULL)
    assert geo.sliding_window == WINDOW
    assert [geo.token_bound(i) for i in range(3)] == [WINDOW - 1, WINDOW - 1, None]
    assert geo.windowed_layers() == [0, 1]


@pytest.mark.parametrize("batch", [1, 2])
def test_full_plan_equals_vanilla_across_the_window(gemma3, batch):
    model, geo = gemma3
    r = full_plan_against_vanilla(model, geo, token_ids(batch, 30, seed=batch), new_tokens=24)
    assert r["stored_after_prefill"] == [WINDOW - 1, WINDOW - 1, 30]
    assert r["stored_after_generate"] == [WINDOW - 1, WINDOW - 1, 30 + 24 - 1]
    assert r["prefill_diff"] < TOL
    assert r["same_tokens"]
    assert r["score_diff"] < TOL


def test_chunked_prefill_and_multi_token_decode_equal_vanilla(gemma3):
    model, geo = gemma3
    prefill_diff, more_diff = chunked_prefill_against_vanilla(model, geo, token_ids(1, 41, seed=5), split=29,
                                                              chunk_size=6)
    assert prefill_diff < TOL
    assert more_diff < TOL


def test_a_plan_never_widens_the_window(gemma3):
    """A capacity above the window keeps the window; quantized sliding layers keep it too."""
    model, geo = gemma3
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=20), decode=OpSpec(rule="h2o", capacity=20),
                               decode_slack=1)
    plan = plan.with_layer(1, k_bits=8, v_bits=8, quantizer_params={"group_size": 16})
    with torch.no_grad(), polykv.apply(model, plan) as session:
        model.generate(token_ids(1, 30, seed=3), max_new_tokens=10, do_sample=False)
        stored = session.cache.stored_tokens()
    assert stored[:2] == [WINDOW - 1, WINDOW - 1]
    assert stored[2] <= 20 + 1


@pytest.mark.parametrize("plan_kw", [
    dict(prefill=OpSpec(rule="snapkv", capacity=5, params={"window": 2, "kernel_size": 3})),
    dict(decode=OpSpec(rule="tova", capacity=6), decode_slack=1),
    dict(prefill=OpSpec(rule="streamingllm", capacity=12), decode=OpSpec(rule="h2o", capacity=10), decode_slack=3),
    dict(prefill=OpSpec(rule="adakv", capacity=5)),
    dict(prefill=OpSpec(rule="adakv", capacity=12), decode=OpSpec(rule="h2o", capacity=6), decode_slack=1),
], ids=["prefill-snapkv", "decode-tova", "streamingllm-h2o", "ragged-adakv", "ragged-adakv-then-h2o"])
def test_compressed_plan_equals_masked_reference(gemma3, plan_kw):
    model, geo = gemma3
    run = record_run(model, polykv.uniform_plan(geo, **plan_kw), token_ids(2, 26, seed=7),
                     continuation=token_ids(2, 4, seed=8), steps=12)
    assert any(s is not None and s[2].shape[-1] < a for s, a, _ in run.forwards)   # the full layer compressed
    ref = masked_reference_logits(model, run)
    assert (run.logits - ref).abs().max().item() < TOL


def test_memory_model_predicts_the_window_bounded_bytes(gemma3):
    model, geo = gemma3
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=12, params={"window": 2}))
    plan = plan.with_layer(0, k_bits=8, v_bits=4, quantizer_params={"group_size": 16})
    with torch.no_grad(), polykv.apply(model, plan) as session:
        model(token_ids(1, 30, seed=9), **{cache_keyword(model): session.new_cache()}, use_cache=True)
        measured = session.resident_bytes()
    report = memory_report(plan, geo, 30, dtype_bytes=4)
    assert [r.kept_tokens for r in report.rows] == [WINDOW - 1, WINDOW - 1, 12]
    assert [r.resident_bytes for r in report.rows] == list(measured.per_layer)
    assert [r.window_bound for r in report.rows] == [WINDOW - 1, WINDOW - 1, None]
    # the uncompressed baseline of a sliding layer is its window, as in vanilla transformers
    assert report.rows[0].full_bytes == 2 * 2 * (WINDOW - 1) * 16 * 4
    assert "w = window-bounded layer (2 of 3)" in report.format_table()


def test_solvers_keep_windowed_layers_and_spend_the_budget_on_full_layers(gemma3):
    _, geo = gemma3
    configs = moend_configs("tova", "both", keeps=(0.25, 0.5, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    rng = np.random.default_rng(0)
    table = rng.uniform(0.1, 1.0, (3, len(configs)))
    table[:, [i for i, c in enumerate(configs) if c.keeps_everything]] = 0.0
    base = Profile.from_table(table, configs, (3, geo.num_kv_heads, geo.head_dim))
    profile = attrs.evolve(base, model=attrs.evolve(base.model, geometry=geo.summary()))
    T = 512
    for solver in ("exact", "moend-greedy", "uniform"):
        plan = polykv.solvers.solve(profile, Budget.of_ratio(4, T), solver=solver)
        assert plan.layers[0].keeps_everything and plan.layers[1].keeps_everything, solver
        per_layer = nominal_bytes(plan, geo, T, phase="decode")
        slot16 = geo.num_kv_heads * geo.head_dim * 4
        assert per_layer[:2] == [(WINDOW - 1) * slot16] * 2, solver      # kept at their window
        assert per_layer[2] <= T * slot16 // 4, solver                      # 4x on the full layer
        assert plan.provenance.predicted_bytes == sum(per_layer), solver
        assert not plan.layers[2].keeps_everything, solver
    with pytest.raises(polykv.errors.SolverError, match="window-bounded layers alone hold"):
        polykv.solvers.solve(profile, Budget.of_bytes(2 * (WINDOW - 1) * slot16, T), solver="exact")
    plan = polykv.solvers.solve(profile, Budget.of_bytes(2 * (WINDOW - 1) * slot16 + T * slot16 // 8, T),
                                solver="exact")
    assert sum(nominal_bytes(plan, geo, T, phase="decode")) <= 2 * (WINDOW - 1) * slot16 + T * slot16 // 8


def test_decode_memory_bound_holds_for_windowed_layers(gemma3):
    """The decode-phase bound of polykv.memory holds at every step, and a sliding layer's is its window."""
    from polykv.testing import decode_soak

    model, geo = gemma3
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="h2o", capacity=12), decode_slack=2)
    worst, bound, over = decode_soak(model, plan, context_tokens=30, steps=20, through_model=True)
    assert over == [0, 0, 0]
    slot = geo.num_kv_heads * geo.head_dim * 4 * 2                   # K + V, float32, one token
    # a sliding layer is cut back to its window (7 tokens), not to the plan's 12 + 2, and its buffers
    # reserve that hold plus the one token a decode forward appends (polykv.storage.token_buffer)
    rows = reserve_tokens(WINDOW - 1, layer_hold(capacity=12, decode_slack=2, bound=WINDOW - 1), slack=2)
    assert rows == WINDOW
    assert bound[:2] == [rows * slot] * 2 and worst[:2] == bound[:2]


def test_a_probe_runs_through_the_windows_as_a_vanilla_forward_of_prompt_and_chunk(gemma3):
    """kvzip on the full layer: each probe chunk's hidden states at every layer's input equal those of a vanilla
    forward of the prompt followed by that chunk (the sliding layers attend through their window)."""
    from polykv.adapters.rules.kvzip import KVzipRule

    model, geo = gemma3
    params = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 16, "n_sink": 2}
    full = polykv.full_plan(geo)
    plan = attrs.evolve(full, layers=tuple(attrs.evolve(lp, prefill=OpSpec(rule="kvzip", capacity=10, params=params))
                                           if geo.layer_types[lp.layer] == FULL else lp for lp in full.layers))
    ids = token_ids(1, 30, seed=0)
    seen = []
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.append((i, (args[0] if args else kwargs["hidden_states"]).clone())),
        with_kwargs=True) for i, m in enumerate(model.model.layers)]
    try:
        with torch.no_grad(), polykv.apply(model, plan) as session:
            session.prefill(ids)
            assert session.cache.stored_tokens() == [WINDOW - 1, WINDOW - 1, 10]
    finally:
        for h in hooks:
            h.remove()
    chunks = KVzipRule(**params).probe_chunks(ids)
    assert len(seen) == 3 * (1 + len(chunks)) and len(chunks) == 2
    for c, chunk in enumerate(chunks):
        with torch.no_grad():
            want = model(torch.cat([ids, chunk.ids], dim=1), output_hidden_states=True).hidden_states
        n = chunk.ids.shape[1]
        for layer in range(3):
            got = [h for i, h in seen if i == layer][1 + c]
            assert (got - want[layer][:, -n:]).abs().max().item() < TOL, (c, layer)
