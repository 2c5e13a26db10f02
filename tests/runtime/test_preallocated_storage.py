"""Preallocated storage in the runtime: in-place appends, in-place eviction, bytes = the reserve = the prediction."""

from __future__ import annotations

import torch

import polykv
from polykv.memory import predict_resident
from polykv.plan import OpSpec
from polykv.storage.token_buffer import GROWTH_BLOCK, cut_back_rows, grown_capacity, reserve_tokens
from polykv.runtime.cache import cache_keyword


def _step(model, session, out):
    return model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): session.cache}, use_cache=True)


def _buffers(layer):
    return (layer.key_store.dequantize().data_ptr(), layer.value_store.dequantize().data_ptr(),
            layer.positions.data_ptr())


def test_decode_appends_in_place_until_a_documented_growth(llama, prompt):
    model, geo = llama
    T = 20
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        out = session.prefill(prompt(1, T))
        layer = session.cache.layers[0]
        assert layer.key_store.capacity == T == reserve_tokens(T, None, slack=16)     # exactly the prompt
        out = _step(model, session, out)                                    # the first token grows it once
        assert layer.key_store.capacity == grown_capacity(T + 1, T) == T + GROWTH_BLOCK
        reserved = T
        T += 1
        ptrs, grew_at = _buffers(layer), []
        for step in range(1, 2 * GROWTH_BLOCK + 1):
            out = _step(model, session, out)
            now = _buffers(layer)
            if now != ptrs:
                grew_at.append(T + step)
                ptrs = now
            assert layer.key_store.capacity == grown_capacity(T + step, reserved)
        # one reallocation each time the buffer was full, never in between
        assert grew_at == [t for t in range(T + 1, T + 2 * GROWTH_BLOCK + 1) if t > grown_capacity(t - 1, reserved)]
        assert grew_at == [reserved + GROWTH_BLOCK + 1, reserved + 2 * GROWTH_BLOCK + 1]
        got = session.resident_bytes()
        want = predict_resident(session.plan, geo, T - 1, dtype_bytes=4, phase="decode", new_tokens=2 * GROWTH_BLOCK + 1)
        assert list(got.per_layer) == [r.resident_bytes for r in want]
        assert [m["positions"] for m in got.metadata_per_layer] == [r.metadata["positions"] for r in want]


def test_eviction_compacts_in_place_and_bytes_match_the_prediction(llama, prompt):
    model, geo = llama
    op = OpSpec(rule="h2o", capacity=12)
    plan = polykv.uniform_plan(geo, prefill=op, decode=op, decode_slack=3)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(2, 40))
        layer = session.cache.layers[1]
        assert layer.key_store.capacity == 12 + 3 + 1
        got = session.resident_bytes()
        want = predict_resident(plan, geo, 40, batch=2, dtype_bytes=4)
        assert list(got.per_layer) == [r.resident_bytes for r in want]
        assert [m["positions"] for m in got.metadata_per_layer] == [r.metadata["positions"] for r in want]
        ptrs = _buffers(layer)
        evictions = 0
        for _ in range(10):
            before = layer.num_stored()
            out = _step(model, session, out)
            evictions += layer.num_stored() < before + 1
            assert _buffers(layer) == ptrs               # appends and evictions never reallocate
            assert layer.num_stored() <= 12 + 3
        assert evictions >= 2
        got = session.resident_bytes()
        want = predict_resident(plan, geo, 40, batch=2, dtype_bytes=4, phase="decode", new_tokens=10)
        assert list(got.per_layer) == [r.resident_bytes for r in want]


def test_a_decode_only_rule_releases_the_prompt_rows_after_its_first_eviction(llama, prompt):
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="tova", capacity=8), decode_slack=2)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(1, 30))
        layer = session.cache.layers[0]
        assert layer.key_store.capacity == 31                  # the whole prompt + the next token
        _step(model, session, out)
        assert layer.num_stored() == 8 and layer.key_store.capacity == 8 + 2 + 1
        want = predict_resident(plan, geo, 30, dtype_bytes=4, phase="decode", new_tokens=1)
        assert list(session.resident_bytes().per_layer) == [r.resident_bytes for r in want]


def test_a_prompt_shorter_than_the_capacity_reserves_its_tokens_and_the_slack(llama, prompt):
    """A 6-token prompt under capacity 64 + slack 4 reserves 6 + 4 + 1 rows, not 64 + 4 + 1; decoding grows the
    buffers another slack at a time (cut_back_rows) until the layer is cut back, and the bytes equal the
    prediction at every step."""
    model, geo = llama
    op = OpSpec(rule="h2o", capacity=16)
    plan = polykv.uniform_plan(geo, prefill=op, decode=op, decode_slack=4)
    hold = 16 + 4
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(1, 6))
        layer = session.cache.layers[0]
        assert layer.key_store.capacity == 6 + 4 + 1 == reserve_tokens(6, hold, slack=4)
        grew = 0
        for step in range(1, 20):
            ptrs = _buffers(layer)
            out = _step(model, session, out)
            grew += _buffers(layer) != ptrs
            want = predict_resident(plan, geo, 6, dtype_bytes=4, phase="decode", new_tokens=step)
            assert list(session.resident_bytes().per_layer) == [r.resident_bytes for r in want], step
            if 6 + step <= hold:
                assert layer.key_store.capacity == cut_back_rows(6, step, hold, slack=4)
            assert layer.key_store.capacity <= hold + 1
        assert 1 <= grew <= 3                            # a reallocation per slack of tokens, not per token


def test_positions_are_preallocated_and_follow_the_tokens(llama, prompt):
    model, geo = llama
    op = OpSpec(rule="streamingllm", capacity=10, params={"n_sink": 2})
    plan = polykv.uniform_plan(geo, prefill=op, decode=op, decode_slack=4)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(1, 25))
        for _ in range(7):
            out = _step(model, session, out)
        pos = session.cache.layers[0].positions[0, 0].tolist()
    assert pos[:2] == [0, 1] and pos[2:] == list(range(32 - len(pos) + 2, 32))
