"""Bad plans through the Python API, where reading and checking a plan choose their work once: the optional
sections (groups, shared pairs, ranks, per-model data) are checked whenever a plan has them, a plan built in
Python is checked by ``validate_plan`` / ``apply`` as a file is by ``load_plan``, and a plan path that is not a
regular file is one PlanError. Each refusal is one line naming the file or layer and field."""

from __future__ import annotations

import os

import attrs
import pytest

import polykv
from cases import mutate, plan_dict
from polykv.errors import PlanError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, LayerPlan, OpSpec
from polykv.plan.io import is_plan_file, parse_plan_dict
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


def _one_line(exc: PlanError, *parts: str) -> str:
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for part in parts:
        assert part in msg, msg
    return msg


@pytest.mark.parametrize("key,value", [("allocation", False), ("allocation", 0), ("allocation", ""),
                                       ("model_data", False), ("model_data", [])])
def test_a_falsy_optional_section_is_read_not_skipped(key, value):
    with pytest.raises(PlanError) as err:
        parse_plan_dict(mutate(plan_dict(), key, value), "p.json")
    _one_line(err.value, "p.json", f"'{key}'")


@pytest.mark.parametrize("key,value", [("budget", False), ("budget", {}), ("created", ""), ("basis", ""),
                                       ("cache_dtype", 0)])
def test_a_falsy_provenance_field_is_read_not_skipped(key, value):
    with pytest.raises(PlanError) as err:
        parse_plan_dict(mutate(plan_dict(), f"provenance.{key}", value), "p.json")
    _one_line(err.value, "p.json", f"provenance.{key}")


def test_share_params_in_a_version_1_file_name_the_share_field():
    with pytest.raises(PlanError) as err:
        parse_plan_dict(mutate(plan_dict(), "layers.1.share_params", {"interpolation": 0.5}), "p.json")
    _one_line(err.value, "layers[1].share", "schema_version")


def test_a_rank_in_a_version_1_file_names_its_layer():
    with pytest.raises(PlanError) as err:
        parse_plan_dict(mutate(plan_dict(), "layers.1.v_rank", 8), "p.json")
    _one_line(err.value, "layer 1", "layers[1].v_rank")


@pytest.mark.parametrize("make", ["folder", "fifo"])
def test_a_plan_path_that_is_not_a_regular_file_is_one_plan_error(tmp_path, make):
    path = tmp_path / "p.json"
    os.mkdir(path) if make == "folder" else os.mkfifo(path)
    with pytest.raises(PlanError) as err:
        polykv.load_plan(str(path))
    _one_line(err.value, str(path), "folder" if make == "folder" else "regular file")
    assert not is_plan_file(str(path))


@pytest.mark.parametrize("op,field", [(OpSpec(rule="snapkv"), "layers[0].prefill.capacity"),
                                      (OpSpec(rule="snapkv", capacity=0), "layers[0].prefill.capacity"),
                                      (OpSpec(rule="snapkv", capacity_ratio=1.5), "layers[0].prefill.capacity_ratio"),
                                      (OpSpec(rule="full", capacity=4), "layers[0].prefill.capacity")])
def test_a_python_plan_with_a_bad_capacity_is_refused_by_validate_and_apply(model, forwards, op, field):
    plan = polykv.per_layer_plan(geometry_of_model(model), [{"prefill": op}, {}])
    with pytest.raises(PlanError) as err:
        polykv.validate_plan(plan)
    _one_line(err.value, field)
    with pytest.raises(PlanError) as err:
        polykv.apply(model, plan)
    _one_line(err.value, field)
    assert forwards == []


def test_a_python_plan_with_share_params_but_no_share_is_refused(model):
    geo = geometry_of_model(model)
    plan = polykv.per_layer_plan(geo, [{}, LayerPlan(layer=1, share_params={"interpolation": 0.5})])
    with pytest.raises(PlanError) as err:
        polykv.validate_plan(plan)
    _one_line(err.value, "layers[1].share_params")


def test_a_python_plan_with_a_group_past_its_layers_is_refused(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=8), decode="full")
    plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="cake", layers=(0, 5)),))
    with pytest.raises(PlanError) as err:
        polykv.validate_plan(plan)
    _one_line(err.value, "allocation[0].layers", "layer 5")
