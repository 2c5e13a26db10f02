"""Bad input on the runtime's plain path through the Python API: a rule's selection (rectangular or ragged, checked
once by the runtime whatever layout the layer has), and the calls a session serves (``prefill``, ``generate``).
Each fails in one line of polykv's own error class, naming the layer, phase and rule, or the call and what to pass.

Neighbours of one kind are probed together: every way a selection's indices can be wrong (dtype, width, order,
range), in prefill and in decode, for a rectangular and for a ragged selection, and every way a prefill's token ids
or chunk size can be wrong.
"""

from __future__ import annotations

import types

import pytest
import torch

import polykv
from polykv.contract.rules import ScoredRule
from polykv.contract.selection import Selection
from polykv.errors import PluginContractError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.registry import Registry
from polykv.storage.token_buffer import PassthroughStore
from polykv.testing import tiny_model, token_ids

CAPACITY = 6
PROMPT = 12


def _newest(ctx, capacity: int) -> torch.Tensor:
    B, Hkv, T = ctx.positions.shape
    return torch.arange(T - capacity, T).expand(B, Hkv, capacity).contiguous()


# What a broken rule returns from select(ctx, capacity), and the words its one line must hold.
BAD_SELECTIONS = {
    "float-indices": (lambda ctx, c: _newest(ctx, c).float(), "int64"),
    "one-too-many": (lambda ctx, c: _newest(ctx, c + 1), f"expected (1, 2, {CAPACITY}) int64"),
    "descending": (lambda ctx, c: _newest(ctx, c).flip(-1).contiguous(), "not strictly ascending"),
    "repeated-column": (lambda ctx, c: torch.cat([_newest(ctx, c)[..., :1], _newest(ctx, c)[..., 1:-1],
                                                  _newest(ctx, c)[..., -2:-1]], -1), "not strictly ascending"),
    "past-the-end": (lambda ctx, c: _newest(ctx, c) + 1, "outside [0,"),
    "negative": (lambda ctx, c: _newest(ctx, c) - ctx.positions.shape[-1], "outside [0,"),
    "ragged-over-a-head": (lambda ctx, c: Selection(index=_newest(ctx, c), counts=torch.full(
        ctx.positions.shape[:2], ctx.positions.shape[-1] + 1)), "per-head counts"),
    "ragged-over-the-budget": (lambda ctx, c: Selection(index=_newest(ctx, c + 1), counts=torch.full(
        ctx.positions.shape[:2], c + 1)), "more than the layer's budget"),
    "ragged-descending": (lambda ctx, c: Selection(index=_newest(ctx, c).flip(-1).contiguous(), counts=torch.full(
        ctx.positions.shape[:2], c)), "not strictly ascending"),
    "ragged-past-the-end": (lambda ctx, c: Selection(index=_newest(ctx, c) + 1, counts=torch.full(
        ctx.positions.shape[:2], c)), "outside [0,"),
}


def _rule(case: str):
    make, _ = BAD_SELECTIONS[case]

    class Bad(ScoredRule):
        name = f"bad-{case}"

        def score(self, ctx):
            return ctx.positions.float()

        def select(self, ctx, capacity):
            return make(ctx, capacity)

    return Bad


def _registry(rule) -> Registry:
    registry = Registry(load_entry_points=False)
    impl = polykv.hookimpl(lambda register: register(rule))
    registry.register_plugin(types.SimpleNamespace(register_rules=impl), name="bad-rules")
    return registry


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1, heads=4, kv_heads=2, head_dim=16)


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("case", sorted(BAD_SELECTIONS))
def test_a_bad_selection_is_refused_in_one_line_naming_the_layer_phase_and_rule(model, case, phase):
    rule = _rule(case)
    geo = geometry_of_model(model)
    op = OpSpec(rule=rule.name, capacity=CAPACITY)
    plan = polykv.uniform_plan(geo, prefill=op, decode="full", decode_slack=1) if phase == "prefill" else \
        polykv.uniform_plan(geo, prefill="full", decode=op, decode_slack=1)
    with pytest.raises(PluginContractError) as err, torch.no_grad(), \
            polykv.apply(model, plan, registry=_registry(rule)) as session:
        cache = session.new_cache()
        out = model(token_ids(1, PROMPT), use_cache=True, **{session.cache_keyword: cache})
        model(out.logits[:, -1:].argmax(-1), use_cache=True, **{session.cache_keyword: cache})
    msg = _one_line(err)
    assert f"layer 0 ({phase}): rule '{rule.name}'" in msg and BAD_SELECTIONS[case][1] in msg
    assert "fix the rule's select()" in msg


def _session(model):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=CAPACITY),
                               decode=OpSpec(rule="h2o", capacity=CAPACITY))
    return polykv.apply(model, plan)


@pytest.mark.parametrize("ids,words", [
    (torch.rand(1, PROMPT), "integer tensor [batch, tokens]"),
    (torch.ones(1, PROMPT, dtype=torch.bool), "integer tensor [batch, tokens]"),
    (token_ids(1, PROMPT)[0], "ids[None]"),
    (token_ids(1, PROMPT).tolist(), "got a list"),
    (token_ids(1, 0), "no tokens"),
], ids=["float", "bool", "1-D", "list", "empty"])
def test_prefill_refuses_what_is_not_token_ids_in_one_line(model, ids, words):
    with pytest.raises(RuntimeConfigError) as err, torch.no_grad(), _session(model) as session:
        session.prefill(ids)
    msg = _one_line(err)
    assert "prefill" in msg and words in msg
    assert session.cache is None  # refused before a cache was built or the model ran


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, "8"])
def test_prefill_refuses_a_chunk_size_that_is_not_a_positive_whole_number(model, chunk_size):
    with pytest.raises(RuntimeConfigError) as err, torch.no_grad(), _session(model) as session:
        session.prefill(token_ids(1, PROMPT), chunk_size=chunk_size)
    msg = _one_line(err)
    assert "prefill(chunk_size=...) must be a positive whole number of tokens" in msg and repr(chunk_size) in msg
    assert session.cache is None


@pytest.mark.parametrize("kwargs,words", [
    ({"num_beams": 2}, "beam search is not supported"),
    ({"cache_implementation": "static"}, "cache_implementation"),
    ({"prompt_lookup_num_tokens": 3}, "prompt lookup decoding"),
], ids=["beams", "cache-implementation", "prompt-lookup"])
def test_generate_refuses_a_mode_a_plan_cannot_serve_before_the_model_runs(model, kwargs, words):
    with pytest.raises(RuntimeConfigError) as err, torch.no_grad(), _session(model) as session:
        model.generate(token_ids(1, PROMPT), max_new_tokens=2, **kwargs)
    msg = _one_line(err)
    assert words in msg and "polykv" in msg
    assert session.cache is None


def test_a_cache_from_another_session_is_refused_by_generate(model):
    with torch.no_grad():
        with _session(model) as first:
            other = first.new_cache()
        with pytest.raises(RuntimeConfigError) as err, _session(model):
            model.generate(token_ids(1, PROMPT), max_new_tokens=2, **{first.cache_keyword: other})
    assert "not this session's live cache" in _one_line(err)


@pytest.mark.parametrize("index,words", [
    (torch.tensor([[[3, 1]]]), "strictly ascending"),
    (torch.tensor([[[1, 4]]]), "out of range"),
    (torch.tensor([[[0.0, 1.0]]]), "integer indices"),
    (torch.tensor([[0, 1]]), "index of shape [1, 1, k]"),
], ids=["descending", "past-the-end", "float", "2-D"])
def test_the_16_bit_store_used_directly_still_checks_every_gather(index, words):
    """A layer's own 16-bit store leaves its gathers to the runtime's checked selections; the same store built by
    a plugin or a test (the default) checks each one, naming the store."""
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    store.append(torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError) as err:
        store.gather(index)
    msg = _one_line(err)
    assert msg.startswith("passthrough store: gather") and words in msg
    assert len(store) == 4
