"""Bad shared layer pairs through the Python API: one clear exception each, naming the layer and field."""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.storage.layer_share import merge_pair
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=3)


@pytest.fixture(scope="module")
def geo(model):
    return geometry_of_model(model)


@pytest.mark.parametrize("change,field", [
    ({"share": 0}, r"layers\[2\]\.share'.*name the layer below \(1\)"),
    ({"share": 1, "k_bits": 4}, r"layers\[2\]\.k_bits'.*quantized shared pairs are not supported"),
    ({"share": 1, "prefill": OpSpec(rule="tova", capacity=8)}, r"layers\[2\]\.prefill\.rule'.*keeps every token"),
    ({"share": 1, "share_params": {"interpolation": float("nan")}}, r"share_params\.interpolation'.*in \[0, 1\]"),
    ({"share_params": {"retention_ratio": 0.1}}, r"layers\[2\]\.share_params'.*without share"),
])
def test_apply_refuses_a_bad_pair_before_the_model_runs(model, geo, change, field):
    plan = polykv.full_plan(geo).with_layer(2, **change)
    with pytest.raises(PlanError, match=field):
        polykv.apply(model, plan)


def test_a_layer_in_two_pairs_is_refused(model, geo):
    plan = polykv.full_plan(geo).with_layer(1, share=0).with_layer(2, share=1)
    with pytest.raises(PlanError, match=r"layers\[2\]\.share'.*layer 1 is itself shared with layer 0"):
        polykv.apply(model, plan)


def test_a_sliding_layer_paired_with_a_full_layer_is_refused():
    m = tiny_model("qwen2", layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    plan = polykv.full_plan(geometry_of_model(m)).with_layer(1, share=0)
    with pytest.raises(PlanError, match=r"layers\[1\]\.share'.*full_attention vs sliding_attention"):
        polykv.apply(m, plan)


def test_two_sliding_layers_are_refused_as_windowed():
    m = tiny_model("qwen2", layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    plan = polykv.full_plan(geometry_of_model(m)).with_layer(2, share=1)
    with pytest.raises(PlanError, match=r"layers\[2\]\.share'.*window bound"):
        polykv.apply(m, plan)


def test_merge_refuses_streams_of_different_shapes():
    with pytest.raises(ValueError, match=r"two \[B, H, T, d\] streams of one shape"):
        merge_pair(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8))


def test_shared_stores_refuse_eviction(model, geo):
    plan = polykv.full_plan(geo).with_layer(1, share=0)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(torch.randint(1, 100, (1, 12)))
        with pytest.raises(RuntimeConfigError, match="keeps every token: its stores cannot evict"):
            session.cache.layers[1].key_store.gather(torch.zeros(1, 2, 3, dtype=torch.long))
