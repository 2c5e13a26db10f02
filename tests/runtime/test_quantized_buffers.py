"""Quantized layers decode into preallocated buffers: the runtime reserves KIVI stores like 16-bit ones, a
decode step writes its codes in place, and the bytes held are what the memory model predicts."""

import pytest
import torch

import polykv
import polykv.registry
from polykv.models.geometry import geometry_of_model
from polykv.memory import predict_resident
from polykv.plan import OpSpec
from polykv.storage.token_buffer import GROWTH_BLOCK
from polykv.testing import tiny_model
from polykv.runtime.cache import cache_keyword

QP = {"group_size": 8, "residual": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64)


def _value_code_moves(session, model, tok, steps):
    """Greedy steps; per layer, how many times the value codes moved to a new buffer."""
    stores = [layer.storage.value_store for layer in session.cache.layers]
    ptrs = [s.buffers["codes"].data.data_ptr() for s in stores]
    moves = [0] * len(stores)
    for _ in range(steps):
        out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        stores = [layer.storage.value_store for layer in session.cache.layers]
        for i, s in enumerate(stores):
            now = s.buffers["codes"].data.data_ptr()  # a new buffer is allocated while the old one lives
            moves[i], ptrs[i] = moves[i] + (now != ptrs[i]), now
    return moves


def test_keep_everything_k4v4_copies_the_value_codes_once_per_growth_block(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=QP)
    ids = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    steps = 40
    with polykv.apply(model, plan) as session:
        out = session.prefill(ids)
        moves = _value_code_moves(session, model, out.logits[:, -1:].argmax(-1), steps)
        assert moves == [-(-steps // GROWTH_BLOCK)] * 2, "a decode step copied the whole quantized stream"
        held = session.resident_bytes()
        # each layer: fresh stores that reserved the 40-token prompt, then took 40 tokens one by one
        kivi = polykv.registry.get_registry().quantizer("kivi")(**QP)
        shape = dict(batch=1, kv_heads=2, head_dim=16, dtype_bytes=4, tokens=40 + steps, reserved=40)
        per_layer = sum(kivi.predict_reserved_bytes(stream, 4, **shape) for stream in ("key", "value"))
        assert held.per_layer == (per_layer, per_layer)
        bound = predict_resident(plan, geo, 40, dtype_bytes=4, phase="decode", new_tokens=steps)
        assert held.total <= sum(r.resident_bytes for r in bound)


def test_an_evicting_k4v4_layer_writes_in_place_between_evictions(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=32), decode=OpSpec(rule="h2o", capacity=32),
                               k_bits=4, v_bits=4, quantizer_params=QP, decode_slack=20)
    ids = torch.randint(1, 64, (1, 60), generator=torch.Generator().manual_seed(1))
    with polykv.apply(model, plan) as session:
        out = session.prefill(ids)
        # 32 kept + 20 slack: the first eviction fires at the 21st token; until then nothing moves
        moves = _value_code_moves(session, model, out.logits[:, -1:].argmax(-1), 20)
        assert moves == [0, 0]
        bound = predict_resident(plan, geo, 60, dtype_bytes=4, phase="decode")
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(60):
            out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            assert session.resident_bytes().total <= sum(r.resident_bytes for r in bound)
