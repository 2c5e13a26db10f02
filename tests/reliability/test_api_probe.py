"""Bad input to a probe rule (kvzip): one clear line each, before the model runs."""

from __future__ import annotations

import pytest

import polykv
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec, validate_plan
from polykv.testing import tiny_model, token_ids

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _not_run(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def test_kvzip_in_decode_is_refused_when_the_plan_is_read(model):
    geo = geometry_of_model(model)
    with pytest.raises(PlanError, match=r"layer 0.*'kvzip'.*decode"):
        validate_plan(polykv.uniform_plan(geo, decode=OpSpec(rule="kvzip", capacity=8, params=IDS)),
                      registry=polykv.get_registry(), geometry=geo)


def test_missing_prompt_ids_are_refused_before_the_model_runs(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=8), decode="full")
    calls, handle = _not_run(model)
    try:  # no tokenizer to build them from: apply refuses, before any forward
        with pytest.raises(RuntimeConfigError) as err:
            polykv.apply(model, plan)
    finally:
        handle.remove()
    msg = str(err.value)
    assert "\n" not in msg and "layer 0 (prefill): rule 'kvzip'" in msg and "repeat_ids" in msg and "tokenizer=" in msg
    assert calls == []


def test_a_probe_past_the_models_positions_is_refused_before_the_model_runs():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=64)
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=8, params=dict(IDS, chunk_size=30)),
                               decode="full")
    calls, handle = _not_run(model)
    try:
        with polykv.apply(model, plan) as session:
            with pytest.raises(RuntimeConfigError, match=r"runs up to 35 tokens after the 40-token prompt, 75 "
                                                         r"positions, more than the model's 64"):
                session.prefill(token_ids(1, 40))
            with pytest.raises(RuntimeConfigError, match="more than the model's 64"):
                model.generate(token_ids(1, 40), max_new_tokens=1)
    finally:
        handle.remove()
    assert calls == []


def test_bad_prompt_ids_are_refused_when_the_plan_is_read(model):
    geo = geometry_of_model(model)
    with pytest.raises(PlanError, match="repeat_ids"):
        validate_plan(polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=8, params={"repeat_ids": ["x"]}),
                                          decode="full"), registry=polykv.get_registry(), geometry=geo)


def test_prefix_covering_the_whole_prompt_is_refused(model):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=8, params=dict(IDS, prefix_tokens=20)),
                               decode="full")
    with polykv.apply(model, plan) as session, pytest.raises(RuntimeConfigError, match="prefix_tokens' is 20"):
        session.prefill(token_ids(1, 20))


def test_calibration_measures_a_probe_rule_by_default(model):
    """Calibration runs a probe rule's probe through the runtime (tests/profiling/test_endtoend.py checks its rows
    against a direct run), so the default rule list includes it."""
    from polykv.profiling.calibrate_settings import default_rules

    assert "kvzip" in default_rules(polykv.get_registry())