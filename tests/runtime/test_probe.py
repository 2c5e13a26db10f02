"""The model pass after prefill (probe, polykv.contract.probe): what the rule's state observes, what the
stores hold afterwards, and that a probe with no selection leaves vanilla logits untouched."""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.contract import ProbeChunk, RuleState, ScoredRule
from polykv.memory import predict_resident
from polykv.plan import OpSpec
from polykv.registry import get_registry
from polykv.plugin_checks import _registry_with

KVZIP = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 16, "n_sink": 2}


class Recorder(RuleState):
    """Records what each forward showed it (the probe's as well as the prompt's)."""

    observes_probe = True

    def __init__(self):
        self.seen = []

    def observe(self, obs):
        self.seen.append({"phase": obs.phase, "q": obs.query.shape[2], "keys": obs.keys.shape[2],
                          "first": obs.first_position, "probe": obs.probe,
                          "positions": obs.positions[0, 0].tolist()})


class ProbeRecorderRule(ScoredRule):
    """A probe of two chunks of fixed ids; keeps the newest tokens (selection never needed in these tests)."""

    name = "probe-recorder"
    phases = frozenset({"prefill"})
    paper = "test rule"
    defaults = {}
    states: list = []

    def probe_chunks(self, prompt_ids):
        B = prompt_ids.shape[0]
        return [ProbeChunk(ids=torch.full((B, 3), 7), span=(0, 4), index=0),
                ProbeChunk(ids=prompt_ids[:, :5].clone(), span=(4, 8), index=1)]

    def new_state(self):
        st = Recorder()
        ProbeRecorderRule.states.append(st)
        return st

    def score(self, ctx):
        return ctx.positions.float()


@pytest.fixture
def registry():
    ProbeRecorderRule.states = []
    return _registry_with("rule", ProbeRecorderRule, registry=get_registry())


def test_probe_forwards_are_observed_after_the_prompt_and_never_stored(llama, prompt, registry):
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="probe-recorder", capacity=100), decode="full")
    ids = prompt(2, 30)
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(ids)
        cache = session.cache
        assert cache.stored_tokens() == [30, 30]
        assert [layer.tokens_seen for layer in cache.layers] == [30, 30]
        assert cache.probe_tokens == 3 + 5
        for layer in cache.layers:
            assert layer.storage.view().positions[0, 0].tolist() == list(range(30))
        got = session.resident_bytes()
        # the next token gets position 30 (the probe's positions 30.. are gone with its K/V)
        model(ids[:, :1], use_cache=True, **{session.cache_keyword: cache})
        assert cache.layers[0].storage.view().positions[0, 0].tolist() == list(range(31))
    want = predict_resident(plan, geo, 30, batch=2, dtype_bytes=4)
    assert list(got.per_layer) == [r.resident_bytes for r in want]
    assert len(ProbeRecorderRule.states) == 2
    for st in ProbeRecorderRule.states:
        phases = [s["phase"] for s in st.seen]
        assert phases == ["prefill", "probe", "probe"]
        prompt_fwd, first, second = st.seen
        assert (prompt_fwd["q"], prompt_fwd["keys"], prompt_fwd["probe"]) == (30, 30, None)
        assert (first["q"], first["keys"], first["first"], first["probe"].index) == (3, 33, 30, 0)
        assert first["positions"] == list(range(33))
        assert (second["q"], second["keys"], second["first"], second["probe"].span) == (5, 35, 30, (4, 8))


def test_probe_rule_without_selection_keeps_vanilla_logits(llama, prompt):
    """kvzip with a capacity above the prompt: the probe runs, nothing is selected, logits equal vanilla."""
    model, geo = llama
    ids = prompt(1, 40)
    kwargs = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=1000, params=KVZIP), decode="full")
    with torch.no_grad():
        ref_prefill = model(ids).logits
        ref = model.generate(ids, **kwargs)
        with polykv.apply(model, plan) as session:
            got_prefill = model(ids, use_cache=True, **{session.cache_keyword: session.new_cache()}).logits
            assert session.cache.probe_tokens == (3 + 1 + 16) + (2 + 8 + 1 + 16) + (2 + 8 + 1 + 8)
            got = model.generate(ids, **kwargs)
            assert session.cache.stored_tokens() == [44, 44]
    assert (got_prefill - ref_prefill).abs().max().item() < 1e-5
    assert torch.equal(got.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores)) < 1e-5


def _kept(model, plan, ids, **prefill):
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids, **prefill)
        return [layer.storage.view().positions.clone() for layer in session.cache.layers]


def test_other_layers_states_do_not_see_the_probe(llama, prompt):
    """Layer 1's SnapKV selects the same tokens whether layer 0 runs kvzip (a probe) or keeps everything."""
    model, geo = llama
    ids = prompt(1, 40)
    snap = {"prefill": OpSpec(rule="snapkv", capacity=12, params={"window": 4}), "decode": OpSpec(rule="full")}
    probe = polykv.per_layer_plan(geo, [{"prefill": OpSpec(rule="kvzip", capacity=12, params=KVZIP)}, snap])
    plain = polykv.per_layer_plan(geo, [{}, snap])
    got, want = _kept(model, probe, ids), _kept(model, plain, ids)
    assert torch.equal(got[1], want[1])
    assert got[0].shape[-1] == 12 and want[0].shape[-1] == 40


def test_chunked_prefill_with_a_probe_selects_as_one_forward(llama, prompt):
    model, geo = llama
    ids = prompt(2, 40)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=10, params=KVZIP), decode="full")
    one, chunked = _kept(model, plan, ids), _kept(model, plan, ids, chunk_size=13)
    for a, b in zip(one, chunked):
        assert torch.equal(a, b)


def test_probe_runs_inside_generate_and_selects_before_decoding(llama, prompt):
    model, geo = llama
    ids = prompt(1, 40)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=10, params=KVZIP), decode="full")
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert session.cache.stored_tokens() == [12, 12]
        assert session.cache.probe_tokens > 0
        generated = out[0, 40:]
    kept = _kept(model, plan, ids)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids)
        assert [layer.storage.view().positions.tolist() for layer in session.cache.layers] == \
            [k.tolist() for k in kept]
    assert generated.shape == (3,)


def test_a_prefill_snapshot_restores_a_probe_plan_as_its_own_prefill(llama, prompt):
    """Prefill reuse (polykv.runtime.fork): the snapshot runs each distinct probe once and a probe plan restored
    from it keeps what its own prefill keeps; a plan without a probe restores from the plain prefill."""
    from polykv.runtime.fork import capture_prefill, restore_prefill

    model, geo = llama
    ids = prompt(1, 40)
    plans = [polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=10, params=KVZIP), decode="full"),
             polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=10, params=dict(KVZIP, chunk_size=9)),
                                 decode="full"),
             polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=10, params={"window": 4}),
                                 decode="full")]
    snapshot = capture_prefill(model, ids, plans)
    assert len(snapshot.variants) == 3
    for plan in plans:
        want = _kept(model, plan, ids)
        with torch.no_grad(), polykv.apply(model, plan) as session:
            cache = restore_prefill(session, snapshot)
            got = [layer.storage.view().positions for layer in cache.layers]
        for a, b in zip(got, want):
            assert torch.equal(a, b)
