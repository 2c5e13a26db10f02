"""Llama 4 chunked attention: a query sees only the earlier tokens of its own chunk, under every plan."""

from __future__ import annotations

import pytest
import torch
import transformers


import polykv
from polykv.geometry import CHUNKED, geometry_of_model
from polykv.plan import OpSpec
from polykv.reference import masked_reference_logits, record_run
from polykv.testing import random_model as build
from polykv.testing import token_ids as ids

TOL = 1e-4
CHUNK = 8


@pytest.fixture(scope="module")
def llama4():
    cfg = transformers.Llama4TextConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, attention_chunk_size=CHUNK, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=256)
    model = build(cfg)
    return model, geometry_of_model(model)


def test_geometry_records_chunked_layers(llama4):
    _, geo = llama4
    assert geo.layer_types == (CHUNKED, CHUNKED)
    assert geo.sliding_window == CHUNK
    assert [geo.token_bound(i) for i in range(2)] == [CHUNK - 1, CHUNK - 1]


def test_full_plan_equals_vanilla_across_chunks(llama4):
    model, geo = llama4
    prompt = ids(2, 24, seed=1)
    kwargs = dict(max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref_prefill = model(prompt).logits
        ref = model.generate(prompt, **kwargs)
        with polykv.apply(model, polykv.full_plan(geo)) as session:
            got_prefill = model(prompt, past_key_values=session.new_cache(), use_cache=True).logits
            got = model.generate(prompt, **kwargs)
            stored = session.cache.stored_tokens()
    assert (got_prefill - ref_prefill).abs().max().item() < TOL       # first token included
    assert torch.equal(got.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores)) < TOL
    assert max(stored) <= CHUNK - 1                                    # the layer's own bound


def test_chunked_prefill_and_multi_token_decode_equal_vanilla(llama4):
    model, geo = llama4
    prompt = ids(1, 37, seed=2)
    with torch.no_grad():
        ref = model(prompt).logits
        with polykv.apply(model, polykv.full_plan(geo)) as session:
            out = session.prefill(prompt[:, :27], chunk_size=5)
            more = model(prompt[:, 27:], past_key_values=session.cache, use_cache=True).logits
    assert (out.logits - ref[:, 25:27]).abs().max().item() < TOL
    assert (more - ref[:, 27:]).abs().max().item() < TOL


@pytest.mark.parametrize("plan_kw", [
    dict(prefill=OpSpec(rule="snapkv", capacity=5, params={"window": 2, "kernel_size": 3})),
    dict(decode=OpSpec(rule="h2o", capacity=4), decode_slack=1),
    dict(prefill=OpSpec(rule="tova", capacity=4), decode=OpSpec(rule="streamingllm", capacity=5), decode_slack=2),
], ids=["prefill-snapkv", "decode-h2o", "tova-streamingllm"])
def test_compressed_plan_equals_masked_reference(llama4, plan_kw):
    model, geo = llama4
    plan = polykv.uniform_plan(geo, **plan_kw)
    run = record_run(model, plan, ids(2, 21, seed=3), continuation=ids(2, 4, seed=4), steps=10)
    ref = masked_reference_logits(model, run)
    assert (run.logits - ref).abs().max().item() < TOL
