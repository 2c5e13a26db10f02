"""Checks that ``polykv.apply`` and plan validation run only when a plan uses what they check (tokenizer
parameters, ranks, per-model data, allocation groups, shared pairs, quantized stores) still refuse, in one line
naming the layer and field, every plan that does use it; and a plain plan still gets what it got before."""

from __future__ import annotations

import attrs
import pytest

import polykv
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec, validate_plan
from polykv.testing import tiny_model

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128)


@pytest.fixture(scope="module")
def plain(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=12,
                                                                        params={"window": 4}),
                               decode=OpSpec(rule="h2o", capacity=8), decode_slack=1)


def _one_line(exc, *words):
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for word in words:
        assert word in msg, msg


def test_a_tokenizer_given_by_name_is_refused_for_a_plain_plan(model, plain):
    with pytest.raises(RuntimeConfigError) as exc:
        polykv.apply(model, plain, tokenizer="gpt2")
    _one_line(exc, "tokenizer", "encode", "AutoTokenizer")


def test_model_data_that_is_not_a_mapping_is_refused_for_a_plain_plan(model, plain):
    with pytest.raises(RuntimeConfigError) as exc:
        polykv.apply(model, plain, model_data=[1, 2])
    _one_line(exc, "model_data", "list")


def test_model_data_given_to_a_plain_plan_is_kept_by_the_session(model, plain):
    data = {"some-key": object()}
    session = polykv.apply(model, plain, model_data={**data, "unset": None})
    assert session.model_data == data


def test_a_plan_file_key_no_rule_reads_is_refused(model, plain):
    plan = attrs.evolve(plain, model_data={"query-stats-typo": "stats.safetensors"})
    with pytest.raises(PlanError) as exc:
        polykv.apply(model, plan)
    _one_line(exc, "model_data.query-stats-typo", "no rule of this plan reads")


@pytest.mark.parametrize("field", ["k_rank", "v_rank"])
def test_a_rank_over_the_head_dim_is_refused(model, plain, field):
    plan = plain.with_layer(1, **{field: 32})
    with pytest.raises(PlanError) as exc:
        polykv.apply(model, plan)
    _one_line(exc, f"layers[1].{field}", "rank 32 exceeds the model's head dim 16")


def test_a_rank_over_the_head_dim_is_refused_without_a_geometry(plain):
    plan = plain.with_layer(0, k_rank=17)
    with pytest.raises(PlanError) as exc:
        validate_plan(plan)
    _one_line(exc, "layers[0].k_rank", "exceeds")


def test_share_params_without_share_are_refused(model, plain):
    plan = plain.with_layer(1, share_params={"x": 1})
    with pytest.raises(PlanError) as exc:
        validate_plan(plan)
    _one_line(exc, "layers[1].share_params", "without share")


def test_a_share_that_is_not_the_layer_below_is_refused(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill="full", decode="full").with_layer(0, share=1)
    with pytest.raises(PlanError) as exc:
        polykv.apply(model, plan)
    _one_line(exc, "layers[0].share", "layer 0 has no layer below")


def test_an_allocation_group_past_the_last_layer_is_refused(model, plain):
    plan = attrs.evolve(plain, allocation=(AllocationGroup(allocator="uniform", layers=(0, 5)),))
    with pytest.raises(PlanError) as exc:
        validate_plan(plan)
    _one_line(exc, "allocation[0].layers", "layer 5")


def test_a_layer_in_two_allocation_groups_is_refused(model, plain):
    groups = (AllocationGroup(allocator="uniform", layers=(0, 1)), AllocationGroup(allocator="uniform", layers=(1,)))
    with pytest.raises(PlanError) as exc:
        validate_plan(attrs.evolve(plain, allocation=groups))
    _one_line(exc, "allocation[1].layers", "groups 0 and 1")


def test_token_ids_outside_the_vocabulary_are_refused(model):
    ids = dict(IDS, suffix_ids=[10, 500])
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzip", capacity=8, params=ids),
                               decode="full")
    with pytest.raises(PlanError) as exc:
        polykv.apply(model, plan)
    _one_line(exc, "params.suffix_ids", "token id 500", "vocabulary")


def test_unset_token_ids_without_a_tokenizer_are_refused(model):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzip", capacity=8), decode="full")
    with pytest.raises(RuntimeConfigError) as exc:
        polykv.apply(model, plan)
    _one_line(exc, "rule 'kvzip'", "tokenizer")
