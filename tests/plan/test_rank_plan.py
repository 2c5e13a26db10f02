"""Plan fields k_rank / v_rank: schema version 2 only when a layer uses them; version-1 files are full rank."""

from __future__ import annotations

import json

import attrs
import pytest

from polykv.errors import PlanError
from polykv.models.geometry import ModelGeometry
from polykv.plan import LayerPlan, load_plan, uniform_plan, validate_plan
from polykv.plan.io import parse_plan_text
from polykv.plan.writing import dumps

GEO = ModelGeometry(model_type="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4)


def test_a_full_rank_plan_writes_version_1_and_its_lines_are_unchanged():
    plan = uniform_plan(GEO)
    text = dumps(plan)
    assert json.loads(text)["schema_version"] == 1
    assert "rank" not in text


def test_a_rank_plan_writes_version_2_and_round_trips(tmp_path):
    plan = uniform_plan(GEO).with_layer(1, k_rank=8, v_rank=4)
    path = tmp_path / "p.plan.json"
    plan.save(str(path))
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 2
    assert raw["layers"][1]["k_rank"] == 8 and "k_rank" not in raw["layers"][0]
    back = load_plan(str(path))
    assert back.layers[1].k_rank == 8 and back.layers[1].v_rank == 4 and back.layers[0].k_rank is None
    assert dumps(back) == path.read_text()


def test_a_version_1_file_loads_as_full_rank():
    plan = parse_plan_text(dumps(uniform_plan(GEO)))
    assert not plan.low_rank and all(lp.rank_of("key", 16) == 16 for lp in plan.layers)


def test_a_version_2_file_without_ranks_loads_and_is_written_as_version_1():
    text = dumps(uniform_plan(GEO)).replace('"schema_version": 1', '"schema_version": 2')
    plan = parse_plan_text(text)
    assert plan.schema_version == 2 and dumps(plan) == dumps(uniform_plan(GEO))


def _with_rank(value, version=2, name="k_rank"):
    raw = json.loads(dumps(uniform_plan(GEO)))
    raw["schema_version"] = version
    raw["layers"][0][name] = value
    return json.dumps(raw)


@pytest.mark.parametrize("value, message", [
    (0, r"layer 0, field 'layers\[0\]\.k_rank'"), (17, r"rank 17 exceeds the head dim 16"),
    ("8", r"field 'layers\[0\]\.k_rank'"), (True, r"field 'layers\[0\]\.k_rank'")])
def test_a_bad_rank_in_a_file_is_one_error_naming_the_field(value, message):
    with pytest.raises(PlanError, match=message):
        parse_plan_text(_with_rank(value))


def test_a_rank_in_a_version_1_file_is_refused():
    with pytest.raises(PlanError, match=r"'v_rank' is a schema version 2 field but the file says version 1"):
        parse_plan_text(_with_rank(8, version=1, name="v_rank"))


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_bad_rank_in_python_is_refused_at_construction(value):
    with pytest.raises(PlanError, match=r"k_rank must be a whole number of channels >= 1"):
        LayerPlan(layer=0, k_rank=value)


def test_a_rank_above_the_model_head_dim_is_refused_by_validation():
    plan = uniform_plan(GEO).with_layer(0, v_rank=32)
    with pytest.raises(PlanError, match=r"layer 0, field 'layers\[0\]\.v_rank': rank 32 exceeds the model's head dim 16"):
        validate_plan(plan, geometry=GEO)
    with pytest.raises(PlanError, match=r"rank 32 exceeds"):
        validate_plan(attrs.evolve(plan, model=None), geometry=GEO)
