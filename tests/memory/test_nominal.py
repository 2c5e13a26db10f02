"""Nominal bytes (MoE-nD's formula) and which op bounds storage in each phase."""

import pytest

from polykv.errors import PlanError
from polykv.models.geometry import ModelGeometry
from polykv.memory import kept_tokens, nominal_bytes
from polykv.plan import LayerPlan, OpSpec, full_plan, per_layer_plan, uniform_plan


def geometry(layers=28, kv_heads=8, head_dim=128, heads=32):
    return ModelGeometry(model_type="llama", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, rope_theta=1e4)


def test_full_sixteen_bit_cache_is_the_reference_number():
    """28 layers x 8 KV heads x head dim 128 x 16,000 tokens x (16 + 16) bits / 8."""
    per_layer = nominal_bytes(full_plan(geometry()), geometry(), 16_000)
    assert len(per_layer) == 28
    assert sum(per_layer) == 1_835_008_000


def test_keep_ratio_and_bits_scale_the_bytes():
    geo = geometry()
    plan = uniform_plan(geo, prefill="snapkv", capacity_ratio=0.25, k_bits=4, v_bits=8)
    # keep 4,000 of 16,000 tokens at 12 bits per element pair
    assert nominal_bytes(plan, geo, 16_000) == [4_000 * 8 * 128 * 12 // 8] * 28
    assert sum(nominal_bytes(plan, geo, 16_000)) * 32 * 4 == 1_835_008_000 * 12


def test_capacity_is_capped_at_the_context():
    geo = geometry(layers=1)
    plan = uniform_plan(geo, prefill="tova", capacity=512)
    assert nominal_bytes(plan, geo, 100) == [100 * 8 * 128 * 4]
    assert nominal_bytes(plan, geo, 1_000) == [512 * 8 * 128 * 4]


def test_odd_bit_totals_round_up_to_a_whole_byte():
    geo = geometry(layers=1, kv_heads=1, head_dim=2)
    plan = uniform_plan(geo, k_bits=2, v_bits=4)
    assert nominal_bytes(plan, geo, 1) == [2]  # 2 channels x 6 bits = 12 bits -> 2 bytes


@pytest.mark.parametrize("prefill,decode,prefill_kept,decode_kept", [
    (OpSpec(rule="snapkv", capacity=256), OpSpec(), 256, 256),                      # nothing evicts in decode
    (OpSpec(rule="snapkv", capacity=256), OpSpec(rule="tova", capacity=512), 256, 512),
    (OpSpec(), OpSpec(rule="h2o", capacity_ratio=0.1), 4_000, 400),                 # decode-only compression
    (OpSpec(), OpSpec(), 4_000, 4_000),
])
def test_the_phase_picks_the_op_that_bounds_storage(prefill, decode, prefill_kept, decode_kept):
    lp = LayerPlan(layer=0, prefill=prefill, decode=decode)
    assert kept_tokens(lp, 4_000, "prefill") == prefill_kept
    assert kept_tokens(lp, 4_000, "decode") == decode_kept
    geo = geometry(layers=1)
    plan = per_layer_plan(geo, [lp])
    assert nominal_bytes(plan, geo, 4_000, phase="decode") == [decode_kept * 8 * 128 * 4]


def test_agrees_with_the_budget_model_the_solvers_use():
    from polykv.profiling.budget import bits_to_bytes, layer_bits

    geo = geometry(layers=3, kv_heads=3, head_dim=64)
    layers = [dict(prefill=OpSpec(rule="snapkv", capacity_ratio=keep), k_bits=kb, v_bits=vb)
              for keep, kb, vb in ((0.1, 4, 4), (0.5, 8, 16), (0.75, 16, 4))]
    plan = per_layer_plan(geo, layers)
    expected = [bits_to_bytes(layer_bits(geo, keep, kb, vb, 3_001))
                for keep, kb, vb in ((0.1, 4, 4), (0.5, 8, 16), (0.75, 16, 4))]
    assert nominal_bytes(plan, geo, 3_001) == expected


def test_geometry_defaults_to_the_plan_model_and_must_match():
    geo = geometry(layers=2)
    plan = full_plan(geo)
    assert nominal_bytes(plan, None, 10) == nominal_bytes(plan, geo, 10)
    with pytest.raises(PlanError, match="2 layers but the model geometry has 28"):
        nominal_bytes(plan, geometry(), 10)
    with pytest.raises(ValueError, match="context_tokens"):
        nominal_bytes(plan, geo, 0)
    with pytest.raises(ValueError, match="phase"):
        nominal_bytes(plan, geo, 10, phase="generate")
