"""KVzip's probe (rule ``kvzip``, allocator ``kvzip``) and its head level (``kvzip-head``) with every runtime
feature: chunked prefill, allocation groups, prefill reuse (polykv.runtime.fork) and batches of several rows."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.errors import RuntimeConfigError
from polykv.adapters.rules.kvzip_heads import HeadScores
from polykv.plan import AllocationGroup, OpSpec
from polykv.runtime.fork import capture_prefill, restore_prefill

KVZIP = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 16, "n_sink": 2}


def _grouped(plan, allocator):
    return attrs.evolve(plan, allocation=(AllocationGroup(allocator=allocator, layers=(0, 1)),))


def _plans(geo):
    kvzip = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=10, params=KVZIP), decode="full")
    head = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip-head", capacity_ratio=0.5, params={"n_sink": 2}),
                               decode="full")
    return {"kvzip": kvzip, "kvzip-pair": _grouped(kvzip, "kvzip"), "kvzip-head": _grouped(head, "kvzip-head")}


def _data(model):
    return {"kvzip-head": HeadScores.measured(torch.tensor([[0.3, 0.8], [0.6, 0.1]]), model, num_tokens=8)}


def _kept(model, plan, ids, **prefill):
    with torch.no_grad(), polykv.apply(model, plan, model_data=_data(model)) as session:
        session.prefill(ids, **prefill)
        return [layer.storage.view().positions.clone() for layer in session.cache.layers], \
            torch.tensor(session.cache.head_counts())


@pytest.mark.parametrize("name", ["kvzip", "kvzip-pair", "kvzip-head"])
def test_chunked_prefill_keeps_what_one_forward_keeps(llama, prompt, name):
    model, geo = llama
    plan, ids = _plans(geo)[name], prompt(1, 40)
    (one, counts), (chunked, chunked_counts) = _kept(model, plan, ids), _kept(model, plan, ids, chunk_size=13)
    assert torch.equal(counts, chunked_counts)
    for a, b in zip(one, chunked):
        assert torch.equal(a, b)
    if name != "kvzip":   # the group's heads keep different counts (ragged storage)
        assert len(set(counts.flatten().tolist())) > 1


@pytest.mark.parametrize("name", ["kvzip-pair", "kvzip-head"])
def test_prefill_reuse_restores_a_grouped_plan_as_its_own_prefill(llama, prompt, name):
    model, geo = llama
    plans = _plans(geo)
    ids = prompt(1, 40)
    snapshot = capture_prefill(model, ids, [plans[name], plans["kvzip"]], model_data=_data(model))
    for plan in (plans[name], plans["kvzip"]):
        want, want_counts = _kept(model, plan, ids)
        with torch.no_grad(), polykv.apply(model, plan, model_data=_data(model)) as session:
            cache = restore_prefill(session, snapshot)
            got = [layer.storage.view().positions for layer in cache.layers]
            assert torch.equal(torch.tensor(cache.head_counts()), want_counts)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["kvzip", "kvzip-head"])
def test_each_row_of_a_batch_keeps_what_it_keeps_alone(llama, prompt, name):
    """kvzip probes every row against its own prompt; kvzip-head's budgets do not depend on the prompt."""
    model, geo = llama
    plan = _plans(geo)[name]
    ids = torch.cat([prompt(1, 40, seed=1), prompt(1, 40, seed=2)])
    both, both_counts = _kept(model, plan, ids)
    for row in range(2):
        alone, alone_counts = _kept(model, plan, ids[row:row + 1])
        assert torch.equal(both_counts[:, row], alone_counts[:, 0])
        for a, b in zip(both, alone):
            assert torch.equal(a[row], b[0])


def test_the_global_kvzip_budget_refuses_a_batch_of_several_rows(llama, prompt):
    model, geo = llama
    with torch.no_grad(), polykv.apply(model, _plans(geo)["kvzip-pair"]) as session:
        with pytest.raises(RuntimeConfigError) as err:
            session.prefill(prompt(2, 40))
    msg = str(err.value)
    assert "\n" not in msg and "allocator 'kvzip'" in msg and "batch of 1" in msg
