"""The report `polykv plan show` prints, and agreement with what the runtime really holds."""

import pytest
import torch

import polykv
from polykv.errors import PlanError
from polykv.models.geometry import ModelGeometry, geometry_of_model
from polykv.memory import memory_report
from polykv.plan import OpSpec, per_layer_plan
from polykv.testing import tiny_model

QP = {"group_size": 8, "residual": 16}


def tiny_plan(geo):
    return per_layer_plan(geo, [
        dict(prefill=OpSpec(rule="snapkv", capacity=40), decode=OpSpec(rule="tova", capacity=48), k_bits=4,
             v_bits=8, quantizer_params=QP),
        dict(),
        dict(prefill=OpSpec(rule="h2o", capacity_ratio=0.5), decode=OpSpec(rule="h2o", capacity_ratio=0.5),
             k_bits=2, v_bits=4, quantizer_params=QP),
        dict(k_bits=8, v_bits=16, quantizer_params=QP),
    ])


@pytest.mark.parametrize("family,batch", [("llama", 1), ("qwen2", 2)])
def test_prediction_matches_the_runtime_after_prefill(family, batch):
    model = tiny_model(family, layers=4, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    plan = tiny_plan(geo)
    ids = torch.randint(0, 128, (batch, 77), generator=torch.Generator().manual_seed(0))
    with polykv.apply(model, plan) as session:
        session.prefill(ids)
        measured = session.resident_bytes()
    report = memory_report(plan, geo, 77, batch=batch, dtype_bytes=4)
    assert list(measured.per_layer) == [r.resident_bytes for r in report.rows]
    assert [dict(m) for m in measured.metadata_per_layer] == [r.metadata for r in report.rows]
    assert measured.total == report.resident_total and measured.metadata_total == report.metadata_total


def test_table_lists_every_layer_and_the_totals():
    geo = ModelGeometry(model_type="llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4)
    report = memory_report(tiny_plan(geo), geo, 77, dtype_bytes=4)
    text = report.format_table()
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "prefill", "decode", "K", "V", "kept", "nominal", "B", "resident", "B",
                                "metadata", "B"]
    assert lines[2].split()[:6] == ["0", "snapkv@40", "tova@48", "4", "8", "40"]
    assert lines[4].split()[:6] == ["2", "h2o@0.5x", "h2o@0.5x", "2", "4", "39"]
    assert f"{report.nominal_total:,}" in lines[7] and f"{report.resident_total:,}" in lines[7]
    assert f"{report.ratio:.2f}x resident" in text and "phase prefill" in text
    assert report.resident_total == sum(r.key_bytes + r.value_bytes for r in report.rows)


def test_unknown_quantizer_or_rule_is_an_error_that_lists_names():
    geo = ModelGeometry(model_type="llama", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4)
    with pytest.raises(Exception, match="unknown quantizer 'nf4'.*Available: kivi"):
        memory_report(per_layer_plan(geo, [dict(k_bits=4, quantizer="nf4")]), geo, 10)
    with pytest.raises(Exception, match="unknown rule 'nope'"):
        memory_report(per_layer_plan(geo, [dict(decode=OpSpec(rule="nope", capacity=4))]), geo, 10)
    with pytest.raises(PlanError, match="layer 0.*divisor of 16"):
        memory_report(per_layer_plan(geo, [dict(v_bits=4)]), geo, 10)  # group_size 32 > head_dim 16
