"""Attention variants served exactly: logit softcapping (Gemma 2), learned sinks (gpt-oss), multi-head models.

Softcap is set small (1.0) so that it changes every softmax; sinks are random per head. Each model
runs past its sliding window (8 tokens) with the keep-everything plan (== vanilla eager attention) and
a compressed plan (== the masked full-cache reference, which applies the same softcap and sinks).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.models.reference import masked_reference_logits, record_run
from polykv.attention.kernels import eager_attention, sdpa
from polykv.testing import full_plan_against_vanilla, random_model, token_ids
from polykv.runtime.cache import cache_keyword

TOL = 1e-4
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=8, pad_token_id=0)


def _gemma2():
    cfg = transformers.Gemma2Config(**SMALL, attn_logit_softcapping=1.0, final_logit_softcapping=None,
                                    query_pre_attn_scalar=16)
    return random_model(cfg, attn_implementation="eager")


def _gpt_oss():
    cfg = transformers.GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1)
    model = random_model(cfg, attn_implementation="eager")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0.0, 2.0)
    return model


def _gpt2():
    return random_model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=256))


BUILDERS = {"gemma2-softcap": _gemma2, "gpt-oss-sinks": _gpt_oss, "gpt2-multi-head": _gpt2}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def variant(request):
    model = BUILDERS[request.param]()
    return request.param, model, geometry_of_model(model)


def test_full_plan_equals_vanilla(variant):
    name, model, geo = variant
    r = full_plan_against_vanilla(model, geo, token_ids(2, 22, seed=1), new_tokens=16)
    assert r["prefill_diff"] < TOL, name
    assert r["same_tokens"], name
    assert r["score_diff"] < TOL, name


@pytest.mark.parametrize("plan_kw", [
    dict(prefill=OpSpec(rule="snapkv", capacity=6, params={"window": 2})),
    dict(prefill=OpSpec(rule="tova", capacity=9), decode=OpSpec(rule="h2o", capacity=7), decode_slack=1),
], ids=["prefill-snapkv", "tova-h2o"])
def test_compressed_plan_equals_masked_reference(variant, plan_kw):
    name, model, geo = variant
    run = record_run(model, polykv.uniform_plan(geo, **plan_kw), token_ids(2, 20, seed=2),
                     continuation=token_ids(2, 3, seed=3), steps=8)
    ref = masked_reference_logits(model, run)
    assert (run.logits - ref).abs().max().item() < TOL, name


def test_softcap_and_sinks_change_the_output():
    """The eager kernel is not a no-op: softcap and sinks move the result away from plain softmax."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=g) * 3 for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    plain = sdpa(q, k, v, 0.25)
    assert torch.allclose(eager_attention(q, k, v, 0.25), plain, atol=1e-5)
    assert (eager_attention(q, k, v, 0.25, softcap=1.0) - plain).abs().max() > 1e-2
    assert (eager_attention(q, k, v, 0.25, sinks=torch.full((4,), 2.0)) - plain).abs().max() > 1e-2


def test_a_model_whose_sliding_window_disagrees_with_its_geometry_is_stopped():
    model = random_model(transformers.Gemma3TextConfig(**SMALL, layer_types=["sliding_attention", "full_attention"]))
    geo = geometry_of_model(model)
    model.model.layers[0].self_attn.sliding_window = 16   # the module passes a window the geometry never recorded
    with pytest.raises(RuntimeConfigError, match="sliding window 16"):
        with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
            model(token_ids(1, 4), **{cache_keyword(model): session.new_cache()}, use_cache=True)
