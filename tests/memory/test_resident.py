"""Resident bytes: exact per-quantizer prediction, metadata apart, ratios for hand-computed plans."""

import pytest
import torch

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.models.geometry import ModelGeometry
from polykv.memory import memory_report, predict_resident
from polykv.plan import OpSpec, full_plan, per_layer_plan, uniform_plan


def geometry(layers=2, kv_heads=2, head_dim=128, heads=8):
    return ModelGeometry(model_type="llama", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, rope_theta=1e4)


def test_int4_codes_count_half_a_byte_per_element():
    geo = geometry(layers=1)
    plan = uniform_plan(geo, k_bits=4, v_bits=4)
    T, G, R = 1_024, 32, 32
    row = predict_resident(plan, geo, T)[0]
    # keys: 1,024 tokens quantized (32 blocks); per group of 32 tokens a bf16 scale + minimum per channel
    assert row.key_bytes == 2 * (T * 128 // 2 + 2 * (T // G) * 128 * 2)
    # values: the last 32 stay bf16; per quantized token 4 groups of 32 channels, each a scale + minimum
    assert row.value_bytes == 2 * ((T - R) * 128 // 2 + 2 * (T - R) * (128 // G) * 2 + R * 128 * 2)


def test_prediction_equals_the_bytes_of_real_stores():
    geo = geometry(layers=3, head_dim=64)
    qp = {"group_size": 16, "residual": 64}
    plan = per_layer_plan(geo, [dict(prefill=OpSpec(rule="snapkv", capacity=300), k_bits=2, v_bits=8, quantizer_params=qp),
                                dict(k_bits=16, v_bits=4, quantizer_params=qp), dict()])
    T, B = 517, 2
    rows = predict_resident(plan, geo, T, batch=B, dtype_bytes=4)
    for lp, row in zip(plan.layers, rows):
        q = KiviQuantizer(**lp.quantizer_params)
        x = torch.randn(B, 2, row.kept_tokens, 64)
        got = []
        for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits)):
            store = q.new_store(stream, bits, dtype=torch.float32, device="cpu")
            store.reserve(row.kept_tokens)   # what the runtime reserves for a layer that keeps everything
            store.append(x[:, :, :100])
            store.append(x[:, :, 100:])
            got.append(store.resident_bytes())
        assert [row.key_bytes, row.value_bytes] == got


# A 16-bit layer whose decode op keeps everything reserves exactly what it keeps (polykv.storage.token_buffer).
@pytest.mark.parametrize("make_plan,ratio", [
    (lambda geo: full_plan(geo), 1.0),
    (lambda geo: uniform_plan(geo, prefill="snapkv", capacity_ratio=0.25), 4.0),
    (lambda geo: uniform_plan(geo, prefill="streamingllm", capacity=128), 8.0),
    # K8/V8, G = R = 32, d = 128, T = 1,024, bf16, per KV head:
    # keys 1,024 x 128 codes + 32 groups x 128 x 2 x 2; values 992 x 128 + 992 x 4 x 2 x 2 + 32 x 128 x 2
    (lambda geo: uniform_plan(geo, k_bits=8, v_bits=8),
     (2 * 1_024 * 128 * 2) / (1_024 * 128 + 32 * 128 * 4 + 992 * 128 + 992 * 4 * 4 + 32 * 128 * 2)),
    # layer 0 full bf16, layer 1 keeps 256 at K4/V4: (2 full) / (1 full + keys 256 x 64 + 8 x 128 x 4
    # + values 224 x 64 + 224 x 4 x 4 + 32 x 128 x 2)
    (lambda geo: per_layer_plan(geo, [dict(), dict(prefill=OpSpec(rule="tova", capacity=256), k_bits=4, v_bits=4)]),
     (2 * 524_288) / (524_288 + 256 * 64 + 8 * 128 * 4 + 224 * 64 + 224 * 4 * 4 + 32 * 128 * 2)),
])
def test_ratio_of_hand_computed_plans(make_plan, ratio):
    geo = geometry()
    report = memory_report(make_plan(geo), geo, 1_024)
    assert report.full_total == 2 * 2 * 2 * 1_024 * 128 * 2  # layers x K,V x Hkv x T x d x bf16
    assert report.ratio == pytest.approx(ratio, rel=1e-12)


def test_nominal_ratio_ignores_scales_and_residuals():
    geo = geometry()
    report = memory_report(uniform_plan(geo, prefill="snapkv", capacity_ratio=0.5, k_bits=4, v_bits=4), geo, 1_024)
    assert report.nominal_ratio == pytest.approx(2 * 32 / 8)
    assert report.ratio < report.nominal_ratio


def test_metadata_positions_accumulated_scores_and_query_window():
    geo = geometry(layers=4)
    plan = per_layer_plan(geo, [
        dict(),                                                                       # positions only
        dict(prefill=OpSpec(rule="h2o", capacity=100), decode=OpSpec(rule="h2o", capacity=100)),
        dict(prefill=OpSpec(rule="h2o", capacity=100)),                               # prefill-only: no scores kept
        dict(decode=OpSpec(rule="tova", capacity=100)),                               # last query kept
    ])
    rows = predict_resident(plan, geo, 1_000, batch=3, dtype_bytes=2)
    # positions live in a buffer of the layer's reserve (polykv.storage.token_buffer): a keep-everything layer reserves
    # what it keeps; an evicting layer capacity + slack (128) + 1 = 229 rows
    assert rows[0].metadata == {"positions": 8 * 3 * 2 * 1_000, "accumulated": 0, "query_window": 0}
    assert rows[1].metadata == {"positions": 8 * 3 * 2 * 229, "accumulated": 4 * 3 * 2 * 100, "query_window": 0}
    assert rows[2].metadata == {"positions": 8 * 3 * 2 * 100, "accumulated": 0, "query_window": 0}
    assert rows[3].metadata["query_window"] == 3 * 8 * 1 * 128 * 2 + 8
    # The KV bytes never include metadata; they are the 16-bit buffers of 229 reserved rows.
    assert rows[1].resident_bytes == 2 * 3 * 2 * 229 * 128 * 2


def test_query_window_without_head_count_is_reported_as_not_counted():
    geo = geometry()
    plan = uniform_plan(geo, decode="tova", capacity=64)
    report = memory_report(plan, plan.model, 500)  # a ModelInfo carries no num_heads
    assert report.rows[0].metadata["query_window"] is None and not report.metadata_complete
    assert "query windows not counted" in report.format_table()
    assert memory_report(plan, plan.model, 500, num_heads=8).metadata_complete
