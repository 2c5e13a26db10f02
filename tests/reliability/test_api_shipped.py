"""Python-API bad inputs of ``polykv.apply`` around per-model data: one exception each, one line, naming the
file looked for, the plan field, the rule and layers, or the parameter."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.contract.model_data import ModelDataError, cached_file
from polykv.plan import OpSpec, uniform_plan
from polykv.adapters.rules.query_stats import compute_query_stats
from polykv.registry import get_registry
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _plan(model, path=None):
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="triattention", capacity=8))
    return attrs.evolve(plan, model_data={"triattention": str(path)} if path else {})


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_file_measured_on_another_model_is_refused_naming_it(model, tmp_path):
    other = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    path = tmp_path / "other.qstats.safetensors"
    compute_query_stats(other, [torch.randint(1, 100, (1, 16))]).save(str(path))
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model, path))
    text = _one_line(err)
    assert str(path) in text and "plan field model_data.triattention" in text and "not measured on this model" in text


def test_a_file_that_is_not_the_data_is_refused_naming_it(model, tmp_path):
    path = tmp_path / "junk.qstats.safetensors"
    path.write_bytes(b"junk")
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model, path))
    assert str(path) in _one_line(err) and "cannot be read" in str(err.value)


def test_refuse_names_every_file_it_looked_for_and_the_rule_and_layers(model, tmp_path):
    path = tmp_path / "missing.qstats.safetensors"
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model, path), missing_model_data="refuse")
    text = _one_line(err)
    need = get_registry().rule("triattention").model_data_need
    assert str(path) in text and cached_file(need, geometry_of_model(model).fingerprint) in text
    assert "rule 'triattention' (layers 0-1)" in text and "missing_model_data='compute'" in text


def test_compute_without_a_tokenizer_says_what_to_pass(model):
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model))
    assert "pass tokenizer=... to compute it from the offline corpus" in _one_line(err)


def test_an_unknown_choice_names_the_parameter(model):
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model), missing_model_data="maybe")
    assert "missing_model_data must be one of ['compute', 'refuse'], got 'maybe'" in _one_line(err)
