"""Bad input at the runtime's attach point (a layer's update handing its step to attention) through the Python API:
one clear line each, naming the layer and what to do; nothing is served silently from keys the cache did not
hand over."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import polykv
from polykv.errors import PolykvError, RuntimeConfigError
from polykv.models.families import build
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.profiling.capture import capture_sequence
from polykv.runtime.cache import cache_keyword
from polykv.testing import tiny_model, token_ids


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def touches_keys():
    """A tiny JetMoe: its attention module repeats the keys and values it got from the cache before attending."""
    built, why = build("jetmoe")
    assert built is not None, why
    return built


def _plan(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=8),
                               decode=OpSpec(rule="h2o", capacity=8), decode_slack=1)


def _one_line(err, *parts) -> None:
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for part in parts:
        assert part in msg, msg


def test_keys_from_another_cache_are_refused_naming_the_cache_to_pass(model):
    with torch.no_grad(), polykv.apply(model, _plan(model)), pytest.raises(RuntimeConfigError) as err:
        model(token_ids(1, 12), use_cache=True, **{cache_keyword(model): DynamicCache(config=model.config)})
    _one_line(err, "layer 0", "session.new_cache()", "use_cache=True")


def test_a_forward_without_a_cache_under_a_compressing_plan_is_refused(model):
    with torch.no_grad(), polykv.apply(model, _plan(model)), pytest.raises(RuntimeConfigError) as err:
        model(token_ids(1, 12), use_cache=False)
    _one_line(err, "layer 0", "session.new_cache()")


def test_the_polykv_attention_outside_a_session_is_refused(model):
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = "polykv"
    try:
        with torch.no_grad(), pytest.raises(RuntimeConfigError) as err:
            model(token_ids(1, 12), use_cache=True)
    finally:
        model.config._attn_implementation_internal = saved
    _one_line(err, "layer 0", "with polykv.apply(model, plan) as session:")


def test_a_caller_4d_mask_is_refused(model):
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    with torch.no_grad(), polykv.apply(model, _plan(model)) as session, pytest.raises(RuntimeConfigError) as err:
        model(token_ids(1, 12), attention_mask=mask, use_cache=True, **{session.cache_keyword: session.new_cache()})
    _one_line(err, "layer 0", "4D attention mask")


def test_a_padded_generate_is_refused_before_the_model_runs(model):
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad(), polykv.apply(model, _plan(model)), pytest.raises(RuntimeConfigError) as err:
        model.generate(ids, attention_mask=mask, max_new_tokens=2)
    _one_line(err, "padded positions", "batch of 1")


def test_a_model_that_changes_its_keys_after_the_update_is_refused(touches_keys):
    geo = geometry_of_model(touches_keys)
    with torch.no_grad(), polykv.apply(touches_keys, polykv.full_plan(geo)) as session, \
            pytest.raises(RuntimeConfigError) as err:
        session.prefill(token_ids(1, 12))
    _one_line(err, "model type 'jetmoe'", "layer 0", "changed the keys", "cannot be served")


def test_calibration_capture_of_a_model_that_changes_its_keys_is_refused(touches_keys):
    """Capture records what attention reads: keys changed after the cache's update would be recorded as if they
    were the layer's keys (repeated per expert), so the capture refuses them."""
    with pytest.raises(PolykvError) as err:
        capture_sequence(touches_keys, token_ids(1, 12))
    _one_line(err, "layer 0", "changed the keys")
