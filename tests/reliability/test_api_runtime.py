"""Bad arguments to the runtime's Python API: one polykv error each, naming the parameter and what to do."""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.errors import PlanError, PolykvError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model, token_ids


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def geo(model):
    return geometry_of_model(model)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert isinstance(exc, PolykvError) and "\n" not in text
    return text


@pytest.mark.parametrize("slack", [0, -5, 2.5, True, "8"])
def test_uniform_plan_refuses_a_decode_slack_below_one(geo, slack):
    with pytest.raises(PlanError) as info:
        polykv.uniform_plan(geo, prefill="snapkv", decode="h2o", capacity=8, decode_slack=slack)
    text = _one_line(info.value)
    assert "trigger.decode_slack" in text and "decode_slack=1" in text and repr(slack) in text


def test_per_layer_plan_refuses_a_decode_slack_below_one(geo):
    with pytest.raises(PlanError, match=r"trigger\.decode_slack.*got 0"):
        polykv.per_layer_plan(geo, [{}] * geo.num_layers, decode_slack=0)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "4"])
def test_prefill_refuses_a_chunk_size_that_is_not_a_positive_whole_number(model, geo, chunk):
    with polykv.apply(model, polykv.full_plan(geo)) as session:
        with pytest.raises(RuntimeConfigError) as info:
            session.prefill(token_ids(1, 12), chunk_size=chunk)
        assert session.cache is None  # refused before any cache was made
    text = _one_line(info.value)
    assert "chunk_size" in text and repr(chunk) in text and "positive whole number" in text


@pytest.mark.parametrize("ids, shown, fix", [
    (token_ids(1, 12)[0], "1-D torch.int64 tensor of shape (12,)", "ids[None]"),
    (token_ids(1, 12)[None], "3-D", "input_ids"),
    (token_ids(1, 12).float(), "torch.float32", "input_ids"),
    ([[1, 2, 3]], "a list", "input_ids"),
])
def test_prefill_refuses_input_ids_that_are_not_a_2d_integer_tensor(model, geo, ids, shown, fix):
    with polykv.apply(model, polykv.full_plan(geo)) as session:
        with pytest.raises(RuntimeConfigError) as info:
            session.prefill(ids)
    text = _one_line(info.value)
    assert "prefill(input_ids)" in text and "[batch, tokens]" in text and shown in text and fix in text


@pytest.mark.parametrize("seed", ["x", 2 ** 70, -1, 1.5, True, None])
def test_apply_refuses_a_seed_torch_cannot_take(model, geo, seed):
    with pytest.raises(RuntimeConfigError) as info:
        polykv.apply(model, polykv.full_plan(geo), seed=seed)
    text = _one_line(info.value)
    assert "apply(seed=...)" in text and repr(seed) in text and "seed=0" in text


def test_apply_takes_the_largest_seed(model, geo):
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo), seed=2 ** 64 - 1) as session:
        session.prefill(token_ids(1, 6))


@pytest.mark.parametrize("data, shown", [(5, "got int"), ("stats", "got str"), ([("a", 1)], "got list"),
                                         ({1: "x"}, "got dict")])
def test_apply_refuses_model_data_that_is_not_a_dict_of_names(model, geo, data, shown):
    with pytest.raises(RuntimeConfigError) as info:
        polykv.apply(model, polykv.full_plan(geo), model_data=data)
    text = _one_line(info.value)
    assert "apply(model_data=...)" in text and shown in text


@pytest.mark.parametrize("value", [5, "stats.safetensors", {"mu": 1}])
def test_apply_refuses_model_data_of_the_wrong_kind_for_the_plan_rules(model, geo, value):
    plan = polykv.uniform_plan(geo, prefill="triattention", capacity=6)
    with pytest.raises(RuntimeConfigError) as info:
        polykv.apply(model, plan, model_data={"triattention": value})
    text = _one_line(info.value)
    assert "model_data['triattention']" in text and type(value).__name__ in text
    assert "query statistics" in text


def test_apply_refuses_a_plan_that_is_not_a_plan(model):
    with pytest.raises(RuntimeConfigError) as info:
        polykv.apply(model, "plans/x.plan.json")
    assert "polykv.load_plan(path)" in _one_line(info.value)
