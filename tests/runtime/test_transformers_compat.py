"""polykv serves every transformers release its pin allows: the cache keyword is feature-detected (``cache``
where the installed transformers has it, ``past_key_values`` before), no call polykv makes raises a
deprecation FutureWarning, and the plan cache answers both layer-cache interfaces (5.0-5.2: ``get_mask_sizes``
takes the cache positions, ``get_max_cache_shape`` is abstract; later: the query length)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.runtime.cache import cache_keyword, output_cache
from polykv.testing import tiny_model

KIVI = {"group_size": 16, "residual": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _plan(model):
    geo = geometry_of_model(model)
    layers = [{"prefill": OpSpec(rule="snapkv", capacity=8, params={"window": 4}),
               "decode": OpSpec(rule="h2o", capacity=8), "k_bits": 4, "v_bits": 8, "quantizer_params": KIVI},
              {"prefill": OpSpec(rule="tova", capacity_ratio=0.5), "decode": OpSpec(rule="tova", capacity=8)}]
    return polykv.per_layer_plan(geo, layers, decode_slack=2)


def test_the_cache_keyword_is_the_one_the_installed_forward_takes(model):
    params = inspect.signature(type(model).forward).parameters
    kw = cache_keyword(model)
    assert kw in params and kw in ("cache", "past_key_values")
    assert kw == "cache" or "cache" not in params


def test_no_polykv_call_raises_a_future_warning(model):
    """generate, prefill, a manual forward on the session's cache, the recorded run and a vanilla decode
    loop (the families check) with every FutureWarning an error."""
    from polykv.models.families import _vanilla
    from polykv.models.reference import record_run

    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    plan = _plan(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad(), polykv.apply(model, plan) as session:
            model.generate(ids, max_new_tokens=4, do_sample=False)
            out = session.prefill(ids, chunk_size=8)
            model(out.logits[:, -1:].argmax(-1), use_cache=True, **{session.cache_keyword: session.cache})
        with torch.no_grad():
            record_run(model, plan, ids, steps=3)
            _vanilla(model, ids, 3)
            output_cache(model(ids, use_cache=True))


def test_the_layer_cache_answers_the_older_cache_interface(model):
    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), polykv.apply(model, _plan(model)) as session:
        session.prefill(ids)
        cache = session.cache
        stored = cache.layers[0].num_stored()
        assert stored == 8
        # transformers 5.0-5.2 call get_mask_sizes(cache_position, layer_idx) with positions [q]
        positions = torch.arange(20, 23)
        assert cache.get_mask_sizes(positions, 0) == cache.get_mask_sizes(3, 0) == (stored + 3, 0)
        assert cache.layers[0].get_max_cache_shape() == -1          # abstract in 5.0-5.2's layer mixin
