"""A storage dtype apart from the compute dtype, and the one-line warning for plans run at another length."""

from __future__ import annotations

import warnings

import pytest
import torch

import polykv
from polykv.memory import context_note, held_bytes_per_layer
from polykv.plan import OpSpec, Provenance, full_plan, uniform_plan
from polykv.runtime.cache import cache_keyword

from .conftest import make_prompt


@pytest.mark.parametrize("k_bits,v_bits", [(16, 16), (4, 8)])
def test_bfloat16_storage_under_float32_compute_holds_what_the_16_bit_model_predicts(llama, k_bits, v_bits):
    model, geo = llama
    plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity_ratio=0.5), k_bits=k_bits, v_bits=v_bits,
                        quantizer_params={"group_size": 16, "residual": 16})
    ids = make_prompt(1, 70)
    with torch.no_grad(), polykv.apply(model, plan, storage_dtype=torch.bfloat16) as session:
        session.prefill(ids)
        held = session.resident_bytes()
        out = model(make_prompt(1, 1, seed=1), **{cache_keyword(model): session.cache}, use_cache=True)
    assert out.logits.dtype == torch.float32  # attention reads the stores back in the compute dtype
    assert held.total + held.metadata_total == sum(held_bytes_per_layer(plan, geo, 70, dtype_bytes=2))
    with torch.no_grad(), polykv.apply(model, plan) as session:  # default: stored in the compute dtype
        session.prefill(ids)
        assert session.resident_bytes().total > held.total


def test_full_plan_in_float32_storage_is_unchanged_and_bfloat16_is_close(llama):
    model, geo = llama
    ids = make_prompt(1, 40)
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
        outs = {}
        for dtype in (None, torch.bfloat16):
            with polykv.apply(model, full_plan(geo), storage_dtype=dtype) as session:
                session.prefill(ids[:, :-1])
                outs[dtype] = model(ids[:, -1:], **{cache_keyword(model): session.cache}, use_cache=True).logits[:, -1]
    torch.testing.assert_close(outs[None], ref, rtol=1e-4, atol=1e-4)
    assert (outs[torch.bfloat16] - ref).abs().max() < 0.1 and not torch.equal(outs[torch.bfloat16], ref)


def test_a_bad_storage_dtype_is_an_error(llama):
    model, geo = llama
    with pytest.raises(polykv.errors.RuntimeConfigError, match="storage_dtype must be a floating-point"):
        polykv.apply(model, full_plan(geo), storage_dtype=torch.int8)


def test_absolute_capacities_at_another_length_warn_once_with_the_real_ratio(llama):
    model, geo = llama
    plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=32), provenance=Provenance(context_tokens=128))
    note = context_note(plan, 64)
    assert "budgeted for a 128-token context but runs on 64 tokens" in note
    assert context_note(plan, 128) is None
    ratio_plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity_ratio=0.25),
                              provenance=Provenance(context_tokens=128))
    assert context_note(ratio_plan, 64) is None  # ratios keep their compression at any length
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with polykv.apply(model, plan) as session:
            session.prefill(make_prompt(1, 64))
            session.prefill(make_prompt(1, 80))
    lines = [str(w.message) for w in caught if issubclass(w.category, polykv.runtime.calls.ContextLengthWarning)]
    assert lines == [note]
