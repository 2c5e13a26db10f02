"""Signals from the attention pass: one chunked pass gives the output and what rule states declared.

The pass (``attention_with_signals``) must equal SDPA and the dense softmax it replaces; states must
read what it produced instead of recomputing; and a plan must select exactly the same tokens as
through the generic path (states computing their own signals), which stays for third-party states.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
import polykv.contract.rules as operators
import polykv.attention.signals as attention_signals
import polykv.contract.state as rule_state
import polykv.attention.attach as attention
from polykv.contract.rules import SelectionContext, window_rows
from polykv.plan import AllocationGroup, OpSpec
from polykv.contract.state import (AccumulatedAttention, CompositeState, Observation, QueryWindow,
                                   RuleState, SignalRequest, attention_column_sums, signal_request)
from polykv.attention.kernels import sdpa
from polykv.attention.signals import attention_with_signals
from polykv.runtime.cache import cache_keyword

EVERYTHING = SignalRequest(column_sums=True, column_sums_per_head=True, last_rows=5)


def _dense(q, k, scaling, valid=None):
    """[B, H, q, K] float64 softmax with the q queries last of the K keys (keys repeated per head)."""
    B, H, n, _ = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(H // Hkv, 1)) * scaling
    seen = torch.arange(K)[None, :] <= torch.arange(n)[:, None] + (K - n)
    seen = seen.view(1, 1, n, K)
    if valid is not None:
        seen = seen & valid.repeat_interleave(H // Hkv, 1).unsqueeze(2)
    return torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)


def _qkv(B, H, Hkv, q, K, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, q, d, generator=g), torch.randn(B, Hkv, K, d, generator=g),
            torch.randn(B, Hkv, K, d, generator=g))


@pytest.mark.parametrize("B,H,Hkv,q,K,chunk", [
    (1, 4, 2, 37, 37, 1 << 20),   # a whole prompt in one chunk
    (2, 6, 3, 37, 37, 300),       # many causal chunks of growing prefixes
    (2, 4, 1, 11, 29, 200),       # a later prefill chunk after stored tokens (MQA)
    (1, 4, 4, 1, 17, 64),         # one decode query (no GQA)
])
def test_pass_equals_sdpa_and_the_dense_softmax(B, H, Hkv, q, K, chunk):
    query, key, value = _qkv(B, H, Hkv, q, K)
    out, sig = attention_with_signals(query, key, value, 0.35, EVERYTHING, chunk_elements=chunk)
    assert (out - sdpa(query, key, value, 0.35)).abs().max() < 1e-5
    probs = _dense(query, key, 0.35)                                               # (B, H, q, K)
    G = H // Hkv
    assert (sig.column_sums.double() - probs.view(B, Hkv, G, q, K).sum((2, 3))).abs().max() < 1e-5
    assert (sig.column_sums_per_head.double() - probs.sum(2)).abs().max() < 1e-5
    r = min(5, q)
    assert sig.last_rows.shape == (B, H, r, K)
    assert (sig.last_rows.double() - probs[:, :, q - r:]).abs().max() < 1e-6
    # and the generic (chunked, recomputing) path agrees within float rounding
    assert (sig.column_sums - attention_column_sums(query, key, 0.35)).abs().max() < 1e-5



@pytest.mark.parametrize("chunk", [120, 400, 1 << 20])
def test_newest_rows_spanning_several_multi_row_chunks(chunk):
    """The last r rows may arrive over several chunks of several rows each: every chunk writes its own."""
    query, key, value = _qkv(1, 4, 2, 40, 40)
    _, sig = attention_with_signals(query, key, value, 0.35, SignalRequest(last_rows=32), chunk_elements=chunk)
    assert (sig.last_rows.double() - _dense(query, key, 0.35)[:, :, 8:]).abs().max() < 1e-6

def test_pass_masks_ragged_padding_and_computes_only_what_is_asked():
    query, key, value = _qkv(2, 4, 2, 1, 12)
    valid = torch.ones(2, 2, 12, dtype=torch.bool)
    valid[0, 1, :5] = False                                    # a head holding fewer tokens, padded in front
    key[0, 1, :5] = float("nan")                               # padding content is never read into a softmax
    out, sig = attention_with_signals(query, key, value, 0.3, SignalRequest(column_sums=True), valid)
    assert sig.column_sums_per_head is None and sig.last_rows is None
    want = _dense(query, key.nan_to_num(), 0.3, valid)
    assert torch.isfinite(out).all()
    assert (sig.column_sums.double() - want.view(2, 2, 2, 1, 12).sum((2, 3))).abs().max() < 1e-6
    assert float(sig.column_sums[0, 1, :5].abs().max()) == 0.0
    assert (out - sdpa(query, key.nan_to_num(), value, 0.3, valid)).abs().max() < 1e-5


def test_bfloat16_pass_is_close_to_float32():
    query, key, value = _qkv(1, 4, 2, 33, 33)
    out32, sig32 = attention_with_signals(query, key, value, 0.35, EVERYTHING)
    out16, sig16 = attention_with_signals(query.bfloat16(), key.bfloat16(), value.bfloat16(), 0.35, EVERYTHING)
    assert out16.dtype == torch.bfloat16 and sig16.column_sums.dtype == torch.float32
    assert (out16.float() - out32).abs().max() < 3e-2
    assert (sig16.column_sums - sig32.column_sums).abs().max() < 3e-2 * sig32.column_sums.abs().max()


def test_observation_reads_the_pass_and_computes_only_once_otherwise(monkeypatch):
    query, key, value = _qkv(1, 4, 2, 9, 9)
    pos = torch.arange(9).expand(1, 2, 9)
    _, sig = attention_with_signals(query, key, value, 0.3, EVERYTHING)
    obs = Observation(layer_idx=0, phase="prefill", query=query, keys=key, positions=pos, valid=None,
                      first_position=0, scaling=0.3, signals=sig)
    assert obs.column_sums() is sig.column_sums and obs.column_sums_per_head() is sig.column_sums_per_head
    assert torch.equal(obs.last_rows(3), sig.last_rows[:, :, 2:])
    assert obs.precomputed_rows(6) is None                     # the pass computed 5
    calls = []
    real = attention_signals.attention_probabilities
    monkeypatch.setattr(attention_signals, "attention_probabilities", lambda *a: calls.append(1) or real(*a))
    plain = attrs.evolve(obs, signals=None)
    assert (plain.column_sums() - sig.column_sums).abs().max() < 1e-6
    assert plain.column_sums() is plain.column_sums() and len(calls) == 1
    assert (plain.column_sums_per_head() - sig.column_sums_per_head).abs().max() < 1e-6
    assert (plain.last_rows(5) - sig.last_rows).abs().max() < 1e-6


def test_states_declare_what_they_need():
    class Own(RuleState):
        needs = frozenset({"column_sums_per_head"})

    window, acc = QueryWindow(7), AccumulatedAttention()
    assert signal_request([window]) == SignalRequest(last_rows=7)
    assert signal_request([None, CompositeState(acc, QueryWindow(3)), window, Own()]) == \
        SignalRequest(column_sums=True, column_sums_per_head=True, last_rows=7)
    assert not signal_request([RuleState(), None]) and signal_request([acc]).needs_every_row

    class Typo(RuleState):
        needs = frozenset({"column_sum"})

    with pytest.raises(ValueError, match="Typo.needs names \\['column_sum'\\]"):
        signal_request([Typo()])


def test_window_attention_folds_heads_and_equals_the_expanded_softmax():
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, w, d = 2, 6, 3, 20, 4, 8
    keys, queries = torch.randn(B, Hkv, T, d, generator=g), torch.randn(B, H, w, d, generator=g)
    positions = torch.arange(T).repeat(B, Hkv, 1)
    positions[1, 2, :3] = -1                                   # ragged padding
    qpos = torch.tensor([14, 16, 18, 19])                      # queries see only tokens at or before them
    got = window_rows(queries, qpos, keys, positions, 0.4)
    k = keys.repeat_interleave(H // Hkv, 1)
    logits = torch.einsum("bhwd,bhtd->bhwt", queries, k) * 0.4
    pos = positions.repeat_interleave(H // Hkv, 1).unsqueeze(2)
    hidden = (pos > qpos.view(1, 1, w, 1)) | (pos < 0)
    want = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    assert (got - want).abs().max() < 1e-6
    operators._WINDOW_CHUNK_ELEMENTS, saved = 7, operators._WINDOW_CHUNK_ELEMENTS
    try:
        assert (window_rows(queries, qpos, keys, positions, 0.4) - want).abs().max() < 1e-6   # one row per chunk
    finally:
        operators._WINDOW_CHUNK_ELEMENTS = saved
    ctx = SelectionContext(layer_idx=0, phase="decode", keys=keys, positions=positions, tokens_seen=20, scaling=0.4,
                           queries=queries, query_positions=qpos)
    assert torch.equal(ctx.window_attention(2), window_rows(queries[:, :, 2:], qpos[2:], keys, positions, 0.4))


def test_query_window_keeps_prefill_rows_only_for_its_own_queries_and_keys():
    query, key, value = _qkv(1, 4, 2, 10, 10)
    pos = torch.arange(10).expand(1, 2, 10)
    _, sig = attention_with_signals(query, key, value, 0.3, SignalRequest(last_rows=4))
    state = QueryWindow(4)
    state.observe(Observation(layer_idx=0, phase="prefill", query=query, keys=key, positions=pos, valid=None,
                              first_position=0, scaling=0.3, signals=sig))
    ctx = SelectionContext(layer_idx=0, phase="prefill", keys=key, positions=pos, tokens_seen=10, scaling=0.3,
                           queries=state.queries, query_positions=state.positions, state=state)
    assert ctx.window_attention(3).data_ptr() == sig.last_rows[:, :, 1:].data_ptr()   # read, not recomputed
    assert (ctx.window_attention(4) - window_rows(state.queries, state.positions, key, pos, 0.3)).abs().max() < 1e-6
    other = attrs.evolve(ctx, positions=pos.flip(-1))            # other keys: recomputed
    assert other.window_attention(1).data_ptr() != sig.last_rows[:, :, 3:].data_ptr()
    assert state.nbytes() == 4 * 4 * 8 * 4 + 4 * 8 + 4 * 4 * 4 * 10
    state.after_prefill()
    assert state.rows is None and state.nbytes() == 4 * 4 * 8 * 4 + 4 * 8
    newest = QueryWindow(1)                                      # a TOVA beside the SnapKV: one row of the four
    newest.observe(Observation(layer_idx=0, phase="prefill", query=query, keys=key, positions=pos, valid=None,
                               first_position=0, scaling=0.3, signals=sig))
    assert torch.equal(newest.rows, sig.last_rows[:, :, 3:])
    assert newest.rows.untyped_storage().nbytes() == 4 * 10 * 4    # holds its row, not the whole slab


def _run(model, plan, ids, chunk=None):
    with torch.no_grad(), polykv.apply(model, plan, seed=3) as session:
        out = session.prefill(ids, chunk_size=chunk) if chunk else session.prefill(ids)
        logits = out.logits[:, -1]
        positions = [layer.positions.clone() for layer in session.cache.layers]
        tok = logits.argmax(-1, keepdim=True)
        for _ in range(3):
            logits = model(tok, **{cache_keyword(model): session.cache}, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
        return positions, logits


PLANS = {
    "h2o": dict(prefill=OpSpec(rule="h2o", capacity=14), decode=OpSpec(rule="h2o", capacity=14)),
    "snapkv+h2o": dict(prefill=OpSpec(rule="snapkv", capacity=14, params={"window": 4, "kernel_size": 3}),
                       decode=OpSpec(rule="h2o", capacity=14)),
    "tova": dict(prefill=OpSpec(rule="tova", capacity=14), decode=OpSpec(rule="tova", capacity=14)),
    "cake": dict(prefill=OpSpec(rule="cake", capacity=14, params={"window": 4}), decode=OpSpec()),
    "scissorhands": dict(prefill=OpSpec(rule="scissorhands", capacity=14, params={"history": 8, "recent": 2})),
    "cam": dict(prefill=OpSpec(rule="cam", capacity=14, params={"rule": "h2o", "merge_window": 3})),
    "d2o": dict(prefill=OpSpec(rule="d2o", capacity=14, params={"n_sink": 2})),
}


@pytest.mark.parametrize("name", list(PLANS) + ["h2o+d2o-allocator"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_signals_from_the_pass_select_what_the_generic_path_selects(llama, prompt, monkeypatch, name, chunk):
    model, geo = llama
    if name == "h2o+d2o-allocator":
        plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=14), decode_slack=2)
        plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="d2o", layers=(0, 1)),))
    else:
        plan = polykv.uniform_plan(geo, decode_slack=2, **PLANS[name])
    ids = prompt(1 if name == "h2o+d2o-allocator" else 2, 45)  # d2o's group budgets serve one row at a time
    used = []
    real = attention.attention_and_signals
    monkeypatch.setattr(attention, "attention_and_signals", lambda *a: used.append(1) or real(*a))
    got_pos, got = _run(model, plan, ids, chunk)
    assert used, "the prefill did not go through the signal pass"
    monkeypatch.setattr(attention, "signal_request", lambda states: SignalRequest())   # states compute their own
    want_pos, want = _run(model, plan, ids, chunk)
    assert all(torch.equal(a, b) for a, b in zip(got_pos, want_pos)), name
    assert (got - want).abs().max() < 1e-4


STATE_HELPERS = ("attention_column_sums", "attention_column_sums_per_head", "attention_last_rows",
                 "attention_probabilities")
"""The attention helpers :mod:`polykv.contract.state` calls when a state computes attention itself (the
attention pass shares their module, so patching the module would catch the pass too)."""


def test_h2o_prefill_reads_column_sums_from_the_pass_and_snapkv_its_rows(llama, prompt, monkeypatch):
    model, geo = llama

    def recompute(*a, **k):
        raise AssertionError("a state recomputed attention the pass had produced")

    for helper in STATE_HELPERS:   # what states call to compute attention themselves
        monkeypatch.setattr(rule_state, helper, recompute)
    monkeypatch.setattr(operators, "window_rows", recompute)
    plan = polykv.uniform_plan(geo, **PLANS["snapkv+h2o"])
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(prompt(1, 40))
        assert session.cache.stored_tokens() == [14, 14]


@pytest.mark.parametrize("name", ["h2o", "snapkv+h2o", "tova"])
def test_decode_states_read_their_signals_from_the_attention_pass(llama, prompt, monkeypatch, name):
    """Every decode step of H2O (column sums) and TOVA (the newest row) attends once: the states read
    the step's probabilities from the pass and nothing recomputes them."""
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode_slack=2, **PLANS[name])
    passes = []
    real = attention.attention_with_signals
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(1, 40))

        def recompute(*a, **k):
            raise AssertionError("a decode state recomputed attention the pass had produced")

        for helper in STATE_HELPERS:   # what states call to compute attention themselves
            monkeypatch.setattr(rule_state, helper, recompute)
        monkeypatch.setattr(operators, "window_rows", recompute)
        monkeypatch.setattr(attention, "attention_with_signals", lambda *a, **k: passes.append(1) or real(*a, **k))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(6):
            tok = model(tok, **{cache_keyword(model): session.cache}, use_cache=True).logits[:, -1:].argmax(-1)
        assert max(session.cache.stored_tokens()) <= 14 + 2
        for layer in session.cache.layers:                  # nothing of a step's signals is held between steps
            window = layer.states["decode"].component(QueryWindow)
            assert window is None or window.rows is None
    assert len(passes) == 6 * geo.num_layers


def test_keep_everything_and_stateless_rules_attend_in_plain_sdpa(llama, prompt, monkeypatch):
    model, geo = llama

    def fused(*a, **k):
        raise AssertionError("no state asked for signals, yet the signal pass ran")

    monkeypatch.setattr(attention, "attention_with_signals", fused)
    for plan in (polykv.full_plan(geo), polykv.uniform_plan(geo, prefill=OpSpec(rule="streamingllm", capacity=9))):
        with torch.no_grad(), polykv.apply(model, plan) as session:
            session.prefill(prompt(1, 30))


def test_a_state_declaring_nothing_still_gets_every_signal(llama, prompt):
    """A third-party state without ``needs``: the generic path computes what it asks for."""
    model, geo = llama
    seen = []

    class Listener(RuleState):
        share_key = None

        def observe(self, obs):
            seen.append((obs.signals, obs.column_sums().clone(), obs.column_sums_per_head().sum(),
                         obs.last_rows(2).shape))

    with torch.no_grad(), polykv.apply(model, polykv.full_plan(geo)) as session:
        cache = session.new_cache()
        cache.layers[0].extra_states.append(Listener())
        ids = prompt(1, 12)
        model(ids, **{cache_keyword(model): cache}, use_cache=True)
    (signals, sums, total, shape), = seen
    assert signals is None and shape == (1, 4, 2, 12)
    assert abs(float(sums.sum()) - 4 * 12) < 1e-4 and abs(float(total) - 4 * 12) < 1e-4   # every row sums to 1

