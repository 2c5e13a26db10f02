"""Decode memory stays within the memory model's bound for every rule x K/V bits x decode slack.

The soak drives the plan cache directly (random post-RoPE keys, values and queries through the runtime's
attention, eviction and quantized stores) on a tiny one-layer model; ``bench/decode_soak.py`` runs the
same grid for thousands of steps and prints the table.
"""

from __future__ import annotations

import pytest
import torch

from polykv.models.geometry import geometry_of_model
from polykv.memory import predict_resident
from polykv.plan import OpSpec, uniform_plan
from polykv.registry import get_registry
from polykv.testing import decode_soak, tiny_model

CAPACITY, CONTEXT, STEPS = 24, 40, 300
QPARAMS = {"group_size": 8, "residual": 16}
DECODE_RULES = sorted(r for r in get_registry().names("rule") if "decode" in get_registry().rule(r).phases)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=16, vocab=64)


@pytest.fixture(scope="module")
def model_data(model):
    from polykv.adapters.rules.query_stats import compute_query_stats

    ids = torch.randint(1, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    # kvzap reads a trained surrogate; one of the model's shape, trained on nothing, exercises its selection
    # (tests/adapters/rules/test_kvzap.py checks the predictions and the training)
    from tests.adapters.rules.test_kvzap import random_surrogate

    return {"triattention": compute_query_stats(model, [ids[:1], ids[1:]]),
            "kvzap": random_surrogate(L=1, Hkv=1, D=32)}


# The quick subset (-m "not slow") soaks every rule and width at slack 1; the larger slacks make the grid
# three times as long (about 25 s on two cores) and run in the whole suite.
@pytest.mark.parametrize("slack", [1, *(pytest.param(s, marks=pytest.mark.slow) for s in (16, 128))])
@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("rule", DECODE_RULES)
def test_measured_decode_bytes_never_exceed_the_bound(rule, bits, slack, model, model_data):
    plan = uniform_plan(geometry_of_model(model), decode=rule, capacity=None if rule == "full" else CAPACITY,
                        k_bits=bits, v_bits=bits, quantizer_params=QPARAMS, decode_slack=slack)
    worst, bound, over = decode_soak(model, plan, context_tokens=CONTEXT, steps=STEPS, model_data=model_data)
    assert over == [0], f"{rule} {bits}/{bits} slack {slack}: measured up to {worst} B, bound {bound} B"
    if rule == "full" or bits == 16:
        assert worst == bound  # the bound is exact where the layout depends on the token count only


def test_the_bound_counts_slack_and_the_residual_of_a_store_after_eviction():
    geo = geometry_of_model(tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=16, vocab=64))
    plan = uniform_plan(geo, decode="h2o", capacity=64, k_bits=8, v_bits=8, quantizer_params=QPARAMS,
                        decode_slack=1)
    row = predict_resident(plan, geo, 96, dtype_bytes=4, phase="decode")[0]
    assert row.kept_tokens == 65                       # capacity + slack
    # the stores reserve hold + 1 = 66 tokens after each eviction (polykv.storage.token_buffer), so the bound is taken there
    # keys: per reserved row 8-bit codes (16 B) + int32 group id + a float32 scale and minimum row (2 * 16 * 4),
    # and beside them up to residual - 1 = 15 keys in float32 (64 B)
    assert row.key_bytes == 66 * (16 + 4 + 128) + 15 * 64
    # values: up to 16 residual values in float32, the rest codes + per-group scale and minimum
    assert row.value_bytes == 16 * 64 + 50 * (16 + 2 * 2 * 4)
    prefill = predict_resident(plan, geo, 96, dtype_bytes=4)[0]
    assert prefill.kept_tokens == 96                   # the prefill phase is unchanged: exact, no eviction yet


def test_a_full_decode_op_grows_with_the_generated_tokens():
    geo = geometry_of_model(tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=16, vocab=64))
    plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=32), decode="full")
    assert predict_resident(plan, geo, 96, phase="decode", new_tokens=10)[0].kept_tokens == 42
    assert predict_resident(plan, geo, 96, phase="decode")[0].kept_tokens == 32
