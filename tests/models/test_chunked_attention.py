"""Llama 4 chunked attention: a query sees only the earlier tokens of its own chunk, under every plan."""

from __future__ import annotations

import pytest
import transformers


import polykv
from polykv.models.geometry import CHUNKED, geometry_of_model
from polykv.plan import OpSpec
from polykv.models.reference import masked_reference_logits, record_run
from polykv.testing import random_model as build
from polykv.testing import chunked_prefill_against_vanilla, full_plan_against_vanilla
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
    r = full_plan_against_vanilla(model, geo, ids(2, 24, seed=1), new_tokens=20)
    assert r["prefill_diff"] < TOL                                     # first token included
    assert r["same_tokens"]
    assert r["score_diff"] < TOL
    assert max(r["stored_after_generate"]) <= CHUNK - 1                # the layer's own bound


def test_chunked_prefill_and_multi_token_decode_equal_vanilla(llama4):
    model, geo = llama4
    prefill_diff, more_diff = chunked_prefill_against_vanilla(model, geo, ids(1, 37, seed=2), split=27, chunk_size=5)
    assert prefill_diff < TOL
    assert more_diff < TOL


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
