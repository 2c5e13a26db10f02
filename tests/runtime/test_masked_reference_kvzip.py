"""KVzip (per-layer ``kvzip``, the global ``kvzip`` allocator, head-level ``kvzip-head``) equals a full-cache
forward whose attention is masked to the retained tokens (the harness of test_masked_reference.py): the probe's
forwards leave no trace in the cache, and ragged heads attend exactly what they store."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.adapters.rules.kvzip_heads import HeadScores
from polykv.plan import AllocationGroup, OpSpec
from tests.runtime.test_masked_reference import PROMPT, QUESTION, TOL, _reference, _run_and_record, stats  # noqa: F401

KVZIP = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 16, "n_sink": 2}


def _plan(geo, name, decode):
    # (a kept kvzip-head head holds its whole prompt: the decode capacity the harness checks must cover it)
    dec = OpSpec(rule=decode, capacity=44 if name == "kvzip-head" else 20) if decode else "full"
    if name == "kvzip-head":
        op = OpSpec(rule="kvzip-head", capacity_ratio=0.5, params={"n_sink": 2})
    else:
        op = OpSpec(rule="kvzip", capacity=12, params=KVZIP)
    plan = polykv.uniform_plan(geo, prefill=op, decode=dec, decode_slack=2)
    if name in ("kvzip-pair", "kvzip-head"):
        plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator=name.split("-pair")[0], layers=(0, 1)),))
    return plan


@pytest.mark.parametrize("name,decode,batch", [("kvzip", None, 2), ("kvzip", "h2o", 2), ("kvzip-pair", None, 1),
                                               ("kvzip-pair", "tova", 1), ("kvzip-head", None, 2),
                                               ("kvzip-head", "h2o", 2)])
def test_kvzip_equals_masked_full_cache(llama, prompt, stats, name, decode, batch):  # noqa: F811
    model, geo = llama
    data = {"kvzip-head": HeadScores.measured(torch.tensor([[0.3, 0.8], [0.6, 0.1]]), model, num_tokens=8)}
    ids, question = prompt(batch, PROMPT, seed=21), prompt(batch, QUESTION, seed=22)
    tokens, logits, records = _run_and_record(model, _plan(geo, name, decode), ids, question, stats,
                                              model_data=data)
    first = records[1][0]   # what each layer stored right after prefill
    assert any(p.shape[-1] < PROMPT or bool((p < 0).any()) for p in first)   # compression happened
    ref = _reference(model, tokens, records, geo.num_layers, geo.num_kv_heads)
    assert (logits - ref).abs().max().item() < TOL
