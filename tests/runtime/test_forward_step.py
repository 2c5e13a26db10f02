"""The explicit forward: a layer cache's update makes a ForwardStep and hands it to attention with the keys it
returns; attention attends as the step says and hands it back; every hand-off is a named object passed as an
argument, and the guards around it name what went wrong.

Shapes: B batch, Hkv KV heads, T prompt tokens, d head dim.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.attention import attach
from polykv.runtime.cache import PlanCache, cache_keyword
from polykv.runtime.layer_cache import LayerCache
from polykv.runtime.layer_spec import CacheSettings, ForwardStep
from polykv.testing import tiny_model

RUNTIME = pathlib.Path(polykv.__file__).parent / "runtime"
QP = {"group_size": 8, "residual": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def runtime_imports() -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports anywhere (top level, inside functions, TYPE_CHECKING)."""
    graph = {}
    for path in RUNTIME.glob("*.py"):
        name = f"polykv.runtime.{path.stem}"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("polykv.runtime."):
                found.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.module == "polykv.runtime":
                found.update(f"polykv.runtime.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("polykv.runtime."))
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` (each as the path that closes it)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_runtime_module_imports_one_that_imports_it_back():
    assert cycles(runtime_imports()) == []


def test_the_circle_check_catches_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def _recorded_steps(monkeypatch) -> list[ForwardStep]:
    """Record every step the attention function hands back to its layer cache."""
    steps = []
    real = LayerCache.after_attention

    def recording(self, step, *args, **kwargs):
        steps.append(step)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(LayerCache, "after_attention", recording)
    return steps


def test_prefill_and_decode_steps_say_what_they_attend(model, monkeypatch):
    """SnapKV in prefill, H2O in decode, 16 bits: the prefill step attends the whole prompt at positions 0..T-1
    and ends it; a decode step attends the kept tokens and the new one, observed by H2O's state."""
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=8),
                               decode=OpSpec(rule="h2o", capacity=8), decode_slack=2)
    steps = _recorded_steps(monkeypatch)
    T, Hkv, d = 20, geo.num_kv_heads, geo.head_dim
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(_ids(T))
        model(_ids(1, seed=1), **{cache_keyword(model): session.cache}, use_cache=True)
        assert all(layer.attended for layer in session.cache.layers)
    prefill, decode = steps[:geo.num_layers], steps[geo.num_layers:]
    for i, step in enumerate(prefill):
        assert (step.layer_idx, step.phase, step.first_position, step.ends_prompt) == (i, "prefill", 0, True)
        assert step.keys.shape == (1, Hkv, T, d) and step.stores is None and step.valid is None
        assert torch.equal(step.positions, torch.arange(T).expand(1, Hkv, T))
        assert step.states  # SnapKV's query window (H2O's accumulated attention too)
    for step in decode:
        assert (step.phase, step.first_position, step.stores) == ("decode", T, None)
        assert step.keys.shape == (1, Hkv, 8 + 1, d)          # the kept tokens + the new one
        assert int(step.positions[0, 0, -1]) == T
        assert [type(st).__name__ for st in step.states] == [type(session.cache.layers[0].states["decode"]).__name__]


def test_a_quantized_decode_step_reads_the_stores_and_carries_only_the_new_keys(model, monkeypatch):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=QP)
    steps = _recorded_steps(monkeypatch)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(_ids(24))
        model(_ids(1, seed=2), **{cache_keyword(model): session.cache}, use_cache=True)
        storages = [layer.storage for layer in session.cache.layers]
    decode = steps[geo.num_layers:]
    assert [step.stores for step in decode] == storages
    assert all(step.keys.shape[2] == 1 and step.positions is None and step.states == () for step in decode)


def test_chunked_prefill_steps_end_the_prompt_only_in_the_last_chunk(model, monkeypatch):
    geo = geometry_of_model(model)
    steps = _recorded_steps(monkeypatch)
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        session.prefill(_ids(20), chunk_size=8)
    ends = [step.ends_prompt for step in steps if step.layer_idx == 0]
    assert ends == [False, False, True]
    assert [step.first_position for step in steps if step.layer_idx == 0] == [0, 8, 16]


def test_a_layer_cache_runs_from_its_settings_alone(model):
    """A LayerCache needs its spec and one CacheSettings, no PlanCache: prefill then decode by hand equals the
    same cache driven through PlanCache."""
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=6), decode=OpSpec(rule="tova", capacity=6),
                               decode_slack=1, k_bits=8, v_bits=8, quantizer_params=QP)
    with polykv.apply(model, plan) as session:
        spec = session.layer_specs[0]
        settings = CacheSettings(decode_slack=1)
        alone = LayerCache(layer_idx=0, spec=spec, settings=settings)
        planned = PlanCache(specs=[spec], settings=settings)
    gen = torch.Generator().manual_seed(3)
    for q in (16, 1, 1, 1):
        k, v = (torch.randn(1, geo.num_kv_heads, q, geo.head_dim, generator=gen) for _ in range(2))
        query = torch.randn(1, geo.num_heads, q, geo.head_dim, generator=gen)
        for layer, step in ((alone, alone.begin(k, v)), (planned.layers[0], planned.begin(k, v, 0))):
            layer.after_attention(step, query, geo.head_dim ** -0.5)
    assert alone.tokens_seen == planned.layers[0].tokens_seen == 19
    assert torch.equal(alone.positions, planned.layers[0].positions)
    assert torch.equal(alone.storage.view().keys, planned.layers[0].storage.view().keys)


def test_attention_reaches_its_layer_through_the_keys_update_returned_only(model):
    """Nothing names the session on the attention modules: the step travels with the keys the cache's update
    returns, and keys that no polykv cache handed over are refused in one line."""
    geo = geometry_of_model(model)
    modules = [layer.self_attn for layer in model.model.layers]
    before = [dict(vars(m)) for m in modules]
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        assert [set(vars(m)) for m in modules] == [set(b) for b in before]
        cache = session.new_cache()
        k = torch.zeros(1, geo.num_kv_heads, 3, geo.head_dim)
        keys, values = cache.update(k, k.clone(), 0)
        assert isinstance(keys, attach.HandedKeys) and not isinstance(values, attach.HandedKeys)
        assert keys.attend.args[0] is cache.layers[0] and keys.attend.args[1].keys.data_ptr() == k.data_ptr()
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(RuntimeConfigError, match=r"^layer 0 attended keys that did not come from a polykv cache: "
                                                 r"call the model inside"):
        attach.polykv_attention(modules[0], q, q[:, :2], q[:, :2], None)


def test_keys_from_another_cache_are_refused(model):
    geo = geometry_of_model(model)
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        session.new_cache()
        with pytest.raises(RuntimeConfigError, match=r"^layer 0 attended keys that did not come from a polykv "
                                                     r"cache: .* pass cache=session.new_cache\(\)"):
            model(_ids(5), **{cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True)


def test_keys_changed_between_the_update_and_attention_are_refused(model, monkeypatch):
    geo = geometry_of_model(model)
    real = PlanCache.update
    def keys_copied(self, *args, **kwargs):  # what a model that touches its keys after the update does
        keys, values = real(self, *args, **kwargs)
        return keys.clone(), values

    monkeypatch.setattr(PlanCache, "update", keys_copied)
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        with pytest.raises(RuntimeConfigError, match=r"^model type 'llama', layer 0: the attention module changed the "
                                                     r"keys between the cache update and attention"):
            model(_ids(5), **{cache_keyword(model): session.new_cache()}, use_cache=True)


def test_a_layer_whose_step_no_attention_took_is_refused_and_forgotten(model):
    """A model whose attention does not run through polykv's function (here: another function registered under
    the name) leaves its layers' steps unattended; the session refuses the forward in one line and forgets them."""
    geo = geometry_of_model(model)
    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        AttentionInterface.register(attach.NAME, sdpa_attention_forward)
        try:
            cache = session.new_cache()
            with pytest.raises(RuntimeConfigError, match=r"^model type 'llama': layers \[0, 1\] stored keys but "
                                                         r"computed attention without the polykv attention function"):
                model(_ids(5), **{cache_keyword(model): cache}, use_cache=True)
        finally:
            attach.register()
        assert all(layer.attended for layer in cache.layers)
