"""Bad input to KVzip (rules ``kvzip`` and ``kvzip-head``) through the Python API: one clear line each, before
the model runs."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.contract.model_data import ModelDataError
from polykv.errors import PlanError, PolykvError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.adapters.rules.kvzip_heads import HeadScores
from polykv.plan import AllocationGroup, OpSpec
from polykv.testing import tiny_model, token_ids

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=64)


def _head_plan(model, **extra):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip-head", capacity_ratio=0.5), decode="full")
    return attrs.evolve(plan, allocation=(AllocationGroup(allocator="kvzip-head", layers=(0, 1)),), **extra)


@pytest.mark.parametrize("rule,params", [("kvzip", IDS), ("kvzip-head", {})])
def test_a_probe_rule_on_a_decode_op_is_refused_by_apply(model, forwards, rule, params):
    """Decode has no prompt: kvzip's probe and kvzip-head's whole-head ranking serve the prefill op only."""
    geo = geometry_of_model(model)
    plan = polykv.per_layer_plan(geo, [{}, {"decode": OpSpec(rule=rule, capacity=8, params=params)}])
    with pytest.raises(PlanError) as err:
        polykv.apply(model, plan)
    msg = str(err.value)
    assert "\n" not in msg and "layer 1" in msg and f"'{rule}'" in msg and "decode" in msg
    assert forwards == []


@pytest.mark.parametrize("how", ["prefill", "chunked", "generate", "reuse"])
def test_a_probe_past_the_models_positions_is_refused_before_the_model_runs(model, forwards, how):
    from polykv.runtime.fork import capture_prefill

    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=8, params=dict(IDS, chunk_size=30)),
                               decode="full")
    ids = token_ids(1, 40)
    with pytest.raises(RuntimeConfigError) as err:
        if how == "reuse":
            capture_prefill(model, ids, [plan])
        else:
            with polykv.apply(model, plan) as session:
                if how == "generate":
                    model.generate(ids, max_new_tokens=1)
                else:
                    session.prefill(ids, chunk_size=16 if how == "chunked" else None)
    msg = str(err.value)
    assert "\n" not in msg and "layer 0: rule 'kvzip'" in msg and "75 positions, more than the model's 64" in msg
    assert "chunk size" in msg
    assert forwards == []


def test_a_head_score_file_of_another_model_is_refused_naming_it_and_both_fingerprints(model, forwards, tmp_path):
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=130)
    path = tmp_path / "other.kvzip-heads.safetensors"
    HeadScores.measured(torch.rand(2, 2), other, num_tokens=10).save(path)
    plan = _head_plan(model, model_data={"kvzip-head": str(path)})
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, plan, missing_model_data="refuse")
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "plan field model_data.kvzip-head" in msg
    assert geometry_of_model(other).fingerprint in msg and geometry_of_model(model).fingerprint in msg
    assert "recompute" in msg
    assert forwards == []


def test_head_scores_of_another_shape_passed_directly_are_refused(model, forwards):
    data = HeadScores(scores=torch.rand(3, 2), fingerprint=None)
    with pytest.raises(PolykvError, match=r"cover 3 layers x 2 KV heads, this model has 2 x 2.*recompute"):
        polykv.apply(model, _head_plan(model), model_data={"kvzip-head": data})
    assert forwards == []


def test_a_file_that_is_not_head_scores_is_refused(model, forwards, tmp_path):
    path = tmp_path / "x.kvzip-heads.safetensors"
    path.write_text("not a safetensors file")
    with pytest.raises(ModelDataError, match=r"x.kvzip-heads.safetensors.*cannot be read.*ProfileError"):
        polykv.apply(model, _head_plan(model, model_data={"kvzip-head": str(path)}))
    assert forwards == []
