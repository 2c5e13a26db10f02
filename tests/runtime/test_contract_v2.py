"""The v2 contract in the runtime: ragged bytes, merges into quantized stores, rule states, allocators."""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.errors import PlanError
from polykv.memory import predict_resident
from polykv.plan import AllocationGroup, OpSpec, load_plan
from polykv.runtime.fork import capture_prefill, restore_prefill
from polykv.runtime.cache import cache_keyword
from tests.runtime.v2_plugins import registry_with_plugins

KIVI = {"group_size": 4, "residual": 4}


@pytest.fixture(scope="module")
def registry():
    return registry_with_plugins()


@pytest.mark.parametrize("bits", [16, 4])
def test_ragged_layer_holds_exactly_its_tokens_and_matches_the_prediction(llama, prompt, registry, bits):
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="test-headwise", capacity=12), k_bits=bits, v_bits=bits,
                               quantizer_params=KIVI)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(prompt(2, 40))
        got = session.resident_bytes()
        counts = session.cache.head_counts()
    assert counts[0] == [[8, 16], [8, 16]]                      # heads differ, the layer keeps 12 x 2
    want = predict_resident(plan, geo, 40, batch=2, dtype_bytes=4, registry=registry, head_counts=counts)
    assert list(got.per_layer) == [r.resident_bytes for r in want]
    assert [m["positions"] for m in got.metadata_per_layer] == [r.metadata["positions"] for r in want]
    if bits == 16:  # memory really freed: 2 rows x (8 + 16) tokens x d 16 x fp32, K and V
        assert got.per_layer[0] == 2 * 2 * (8 + 16) * 16 * 4


def test_ragged_decode_on_quantized_storage_splits_heads_without_requantizing(llama, prompt, registry):
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="test-headwise", capacity=10), k_bits=4, v_bits=4,
                               quantizer_params=KIVI, decode_slack=1)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        out = session.prefill(prompt(1, 16, seed=3))
        layer = session.cache.layers[0]
        keys = layer.storage.view().keys
        before = {(h, int(p)): keys[0, h, c].clone() for h in range(2) for c, p in enumerate(layer.positions[0, h].tolist())}
        model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): session.cache}, use_cache=True)
        assert layer.storage.ragged
        view = layer.storage.view()
        checked = 0
        for h in range(2):
            for c, p in enumerate(view.positions[0, h].tolist()):
                if 0 <= p < 12:   # quantized before the split: codes kept as they were
                    assert torch.equal(view.keys[0, h, c], before[(h, p)])
                    checked += 1
        assert checked > 5


def test_merge_into_quantized_store_requantizes_only_touched_groups(llama, prompt, registry):
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="test-merge", capacity=12, params={"keys": True}),
                               k_bits=4, v_bits=4, quantizer_params=KIVI, decode_slack=1)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        out = session.prefill(prompt(1, 12, seed=5))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        cost = session.cache.layers[0].storage.write_cost
    # 12 -> 14 stored twice (slack 1): two evictions, each merging into the oldest kept token of each of
    # the 2 heads, keys and values. Per eviction and head, the target's key group (4 tokens x d channels)
    # and the target's value (d / G = 4 groups) are re-encoded; nothing else.
    assert cost.tokens_written == 2 * 2 * 2
    assert cost.tokens_requantized == 2 * 2 * (4 + 1)
    assert cost.groups_requantized == 2 * 2 * (16 + 4)


def test_kivi_write_reencodes_only_the_groups_it_touches():
    from polykv.adapters.quantizers.kivi import KiviQuantizer

    q = KiviQuantizer(group_size=4, residual=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 14, 8, generator=g)
    for stream in ("key", "value"):
        store = q.new_store(stream, 4, dtype=torch.float32, device="cpu")
        store.append(x)
        old = store.dequantize()
        mask = torch.zeros(1, 2, 14, dtype=torch.bool)
        mask[0, 0, 5] = mask[0, 1, 13] = True                       # a quantized token and a residual one
        new = old.clone()
        new[0, 0, 5] += 1.0
        new[0, 1, 13] += 1.0
        cost = store.write(mask, new)
        now = store.dequantize()
        assert torch.equal(now[0, 1, 13], new[0, 1, 13])            # residual: exact
        assert (now[0, 0, 5] - new[0, 0, 5]).abs().max() < 0.5      # re-encoded near the written value
        untouched = torch.ones(14, dtype=torch.bool)
        untouched[4:8 if stream == "key" else 6] = False            # key group 1 = tokens 4..7; value token 5
        assert torch.equal(now[0, 0, untouched], old[0, 0, untouched])
        assert torch.equal(now[0, 1, :13], old[0, 1, :13])
        assert cost.tokens_written == 2
        assert cost.tokens_requantized == (4 if stream == "key" else 1)


def test_a_stateful_rule_owns_its_state_and_a_new_cache_resets_it(llama, prompt, registry):
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="test-seen", capacity=10), decode_slack=1)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        out = session.prefill(prompt(1, 14))
        model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): session.cache}, use_cache=True)
        state = session.cache.layers[0].states["decode"]
        assert state.counts.shape == (1, 2, 10)
        assert session.resident_bytes().metadata_per_layer[0]["rule_state"] == 1 * 2 * 10 * 4
        session.new_cache()
        assert session.cache.layers[0].states["decode"] is not state
        assert session.cache.layers[0].states["decode"].counts is None
    rows = predict_resident(plan, geo, 14, batch=1, dtype_bytes=4, registry=registry)
    assert rows[0].metadata["rule_state"] == 1 * 2 * 14 * 4


def _alloc_plan(geo, allocator, capacity=12, decode=None):
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="key-norm", capacity=capacity), decode=decode,
                               decode_slack=1)
    import attrs

    return attrs.evolve(plan, allocation=(AllocationGroup(allocator=allocator, layers=(0, 1)),))


def test_allocator_distributes_the_group_total_after_prefill(llama, prompt, registry):
    model, geo = llama
    plan = _alloc_plan(geo, "test-layer-share")
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(prompt(1, 40))
        alloc = session.allocations()
        stored = session.cache.stored_tokens()
        got = session.resident_bytes()
    assert alloc == {0: {"budget": 8, "stored": [[8, 8]]}, 1: {"budget": 16, "stored": [[16, 16]]}}
    assert stored == [8, 16]
    bound = predict_resident(plan, geo, 40, dtype_bytes=4, registry=registry)
    assert all(r.bound for r in bound) and [r.kept_tokens for r in bound] == [24, 24]
    exact = predict_resident(plan, geo, 40, dtype_bytes=4, registry=registry, allocations=alloc)
    assert list(got.per_layer) == [r.resident_bytes for r in exact]
    assert all(g <= r.resident_bytes for g, r in zip(got.per_layer, bound))
    from polykv.memory import memory_report

    table = memory_report(plan, geo, 40, registry=registry).format_table()
    assert "<=24" in table and "allocator decides" in table
    assert "allocation group test-layer-share[0..1]: at most 24 tokens per KV head" in table


def test_cascading_allocator_reallocates_after_every_layer(llama, prompt, registry):
    model, geo = llama
    plan = _alloc_plan(geo, "test-cascade")
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(prompt(1, 40))
        run = session.cache.runs[0]
        assert run.allocator.calls == [(0,), (0, 1)]
        assert session.cache.stored_tokens() == [8, 16]


def test_per_head_allocation_gives_ragged_layers_and_decode_keeps_the_budgets(llama, prompt, registry):
    model, geo = llama
    plan = _alloc_plan(geo, "test-head-share", decode=OpSpec(rule="key-norm", capacity=12))
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        out = session.prefill(prompt(1, 40))
        assert session.allocations()[0] == {"budget": [8, 16], "stored": [[8, 16]]}
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(6):
            out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        counts = session.cache.head_counts()
    # decode evicts back to the allocated per-head budgets (8 + 16 per row) once 2 x slack 1 are exceeded
    assert all(sum(row) <= 24 + 2 for layer in counts for row in layer)
    assert all(row[0] < row[1] for layer in counts for row in layer)


def test_snapshot_restore_runs_the_allocator_like_prefill(llama, prompt, registry):
    model, geo = llama
    plan = _alloc_plan(geo, "test-layer-share", decode=OpSpec(rule="h2o", capacity=12))
    ids = prompt(1, 40, seed=2)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(ids)
        want = [layer.positions.clone() for layer in session.cache.layers]
        want_acc = session.cache.layers[1].states["decode"].sums.clone()
    snap = capture_prefill(model, ids, [plan], registry=registry)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        restore_prefill(session, snap)
        assert all(torch.equal(a, layer.positions) for a, layer in zip(want, session.cache.layers))
        assert torch.allclose(session.cache.layers[1].states["decode"].sums, want_acc)


def test_plan_files_carry_allocation_groups_and_reject_bad_ones(tmp_path, llama, registry):
    _, geo = llama
    plan = _alloc_plan(geo, "test-layer-share")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert load_plan(str(path), registry=registry) == plan
    text = path.read_text().replace('"allocator": "test-layer-share"', '"allocator": "nope"')
    path.write_text(text)
    with pytest.raises(PlanError, match="unknown allocator 'nope'") as err:
        load_plan(str(path), registry=registry)
    assert err.value.field == "allocation[0].allocator" and str(path) in str(err.value)
    text = text.replace('"layers": [0, 1]', '"layers": [1, 0]')
    path.write_text(text)
    with pytest.raises(PlanError, match="ascending") as err:
        load_plan(str(path))
    assert err.value.field == "allocation[0].layers"
