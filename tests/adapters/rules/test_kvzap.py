"""KVzap (rule and allocator ``kvzap``): the surrogate's forward against a loop over tokens and outputs, the
selection (fixed ratio and threshold) against hand-picked indices, training against the ``kvzip`` rule's own scores
and a vanilla forward's attention inputs, the surrogate file, the attention input the rule sees against a vanilla
forward's, and the rule running through ``polykv.apply`` with its memory freed and no hook for other plans."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.nn.functional as F
import transformers

import polykv
from polykv.adapters.rules.kvzap import KVzapAllocator, KVzapRule, PredictedScores
from polykv.adapters.rules.kvzap_model import KVzapSurrogate
from polykv.adapters.rules.kvzap_train import (SINK, collect, fit_linear, fit_mlp, mlp_forward, text_samples,
                                               train_kvzap)
from polykv.adapters.rules.kvzip import prompt_params
from polykv.contract.rules import SelectionContext
from polykv.contract.selection import as_selection
from polykv.contract.state import Observation
from polykv.errors import ProfileError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec
from polykv.registry import Registry
from polykv.runtime import calls
from polykv.runtime.cache import cache_keyword
from polykv.runtime.fork import capture_prefill, restore_prefill
from polykv.runtime.session import run_probe
from polykv.testing import random_model, tiny_model, token_ids


class Tok:
    """A tokenizer without a chat template whose ids fit the tiny models' vocabulary."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 97 for ch in text]


def random_surrogate(L=2, Hkv=2, D=32, h=5, seed=0, fingerprint=None) -> KVzapSurrogate:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    return KVzapSurrogate(feat_mean=r(L, D), feat_std=r(L, D).abs() + 0.5, lin_w=r(L, D, Hkv), lin_b=r(L, Hkv),
                          mlp_w1=r(L, D, h), mlp_b1=r(L, h), mlp_w2=r(L, h, Hkv), mlp_b2=r(L, Hkv),
                          fingerprint=fingerprint)


def loop_scores(s: KVzapSurrogate, layer: int, hidden, kind: str) -> torch.Tensor:
    """The surrogate's score of every token and head, one token and one output at a time, as the module docstring
    writes it: hidden [B, T, D] -> [B, Hkv, T] float64."""
    B, T, D = hidden.shape
    out = torch.empty(B, s.num_kv_heads, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            x = (hidden[b, t].double() - s.feat_mean[layer].double()) / s.feat_std[layer].double()
            for h in range(s.num_kv_heads):
                if kind == "linear":
                    out[b, h, t] = sum(float(x[i]) * float(s.lin_w[layer, i, h]) for i in range(D)) \
                        + float(s.lin_b[layer, h])
                else:
                    hid = [float(F.gelu(x @ s.mlp_w1[layer, :, k].double() + s.mlp_b1[layer, k].double()))
                           for k in range(s.hidden)]
                    out[b, h, t] = sum(hid[k] * float(s.mlp_w2[layer, k, h]) for k in range(s.hidden)) \
                        + float(s.mlp_b2[layer, h])
    return out


def observed(s: KVzapSurrogate, hidden, *, layer=1, kind="mlp", Hkv=2, state=None) -> PredictedScores:
    """A kvzap state after one forward of the tokens whose attention inputs are ``hidden`` [B, q, D] (appended)."""
    state = state if state is not None else PredictedScores(kind)
    B, q, _ = hidden.shape
    K = q + (0 if state.scores is None else state.scores.shape[-1])
    state.observe(Observation(layer_idx=layer, phase="prefill", query=torch.zeros(B, 2 * Hkv, q, 8),
                              keys=torch.zeros(B, Hkv, K, 8), positions=torch.arange(K).expand(B, Hkv, K),
                              valid=None, first_position=K - q, scaling=0.3, attention_input=hidden,
                              model_data={"kvzap": s}))
    return state


def context(T, *, state, layer=1, B=1, Hkv=2, **kw) -> SelectionContext:
    return SelectionContext(layer_idx=layer, phase="prefill", keys=torch.zeros(B, Hkv, T, 8),
                            positions=torch.arange(T).expand(B, Hkv, T), tokens_seen=T, scaling=0.3, state=state, **kw)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_surrogate_forward_matches_a_loop_over_tokens_and_heads(kind):
    s = random_surrogate(Hkv=3, D=12)
    hidden = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(3))
    got = s.predict(1, hidden, surrogate=kind)
    assert got.shape == (2, 3, 7) and got.dtype == torch.float32
    assert torch.allclose(got.double(), loop_scores(s, 1, hidden, kind), atol=1e-4)


def test_fixed_ratio_keeps_the_top_scores_per_head_after_the_sinks():
    s = random_surrogate(seed=2)
    hidden = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(4))
    ctx = context(12, state=observed(s, hidden))
    scores = loop_scores(s, 1, hidden, "mlp")[0]                                                    # (Hkv, T)
    idx = KVzapRule(n_sink=2).select(ctx, 5)
    for h in range(2):
        rest = (scores[h, 2:].topk(3).indices + 2).tolist()
        assert idx[0, h].tolist() == sorted([0, 1] + rest)


def test_threshold_keeps_scores_above_tau_with_sinks_and_window_under_the_ceiling():
    s = random_surrogate(seed=5)
    hidden = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(6))
    ctx = context(20, state=observed(s, hidden, kind="linear"))
    scores = loop_scores(s, 1, hidden, "linear")[0]
    middle = scores[:, 1:17].flatten().sort().values[15:17]
    tau = float(middle.mean())                                            # half the heads' middle scores above it
    sel = KVzapRule(surrogate="linear", threshold=tau, n_sink=1, window=3).select(ctx, 15)
    for h in range(2):
        want = sorted({0, 17, 18, 19} | {t for t in range(20) if scores[h, t] > tau})
        c = int(sel.counts[0, h])
        assert c == len(want) and sel.index[0, h, sel.width - c:].tolist() == want
    # a ceiling below the count above tau keeps the protected tokens, then the best of the rest
    sel = KVzapRule(surrogate="linear", threshold=-1e6, n_sink=1, window=3).select(ctx, 6)
    for h in range(2):
        best = (scores[h, 1:17].topk(2).indices + 1).tolist()
        assert sel.index[0, h, sel.width - int(sel.counts[0, h]):].tolist() == sorted([0, 17, 18, 19] + best)


def test_the_window_defaults_to_the_papers_128_only_with_a_threshold():
    assert KVzapRule().recent == 0 and KVzapRule(threshold=-4.0).recent == 128
    assert KVzapRule(threshold=-4.0, window=0).recent == 0


def test_scores_are_predicted_as_tokens_arrive_and_follow_the_stored_tokens():
    s = random_surrogate(seed=7)
    g = torch.Generator().manual_seed(8)
    prompt, step = torch.randn(1, 10, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    state = observed(s, prompt)
    assert torch.allclose(state.scores.double(), loop_scores(s, 1, prompt, "mlp"), atol=1e-4)
    sel = KVzapRule().select(context(10, state=state), 6)
    state.gather(as_selection(sel))                                       # the kept tokens' scores, in storage order
    kept = loop_scores(s, 1, prompt, "mlp").gather(-1, as_selection(sel).index)
    observed(s, step, state=state)                                        # a decode step: its token appended last
    assert state.scores.shape == (1, 2, 7)
    assert torch.allclose(state.scores[..., :6].double(), kept, atol=1e-4)
    assert torch.allclose(state.scores[..., 6:].double(), loop_scores(s, 1, step, "mlp"), atol=1e-4)


def test_a_forward_without_its_attention_input_is_refused_in_one_line():
    state = PredictedScores("mlp")
    with pytest.raises(RuntimeConfigError) as err:
        state.observe(Observation(layer_idx=3, phase="decode", query=torch.zeros(1, 4, 1, 8),
                                  keys=torch.zeros(1, 2, 1, 8), positions=torch.zeros(1, 2, 1, dtype=torch.long),
                                  valid=None, first_position=0, scaling=0.3, model_data={"kvzap": random_surrogate()}))
    msg = str(err.value)
    assert "\n" not in msg and "layer 3 (decode)" in msg and "hidden states entering" in msg


def test_ridge_is_the_closed_form_and_the_mlp_lowers_its_loss():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 400, 6, generator=g)
    y = torch.stack([torch.sin(x[..., 0]) * 2 + x[..., 1] ** 2 - 1, x[..., 2].abs() - x[..., 3]], -1) \
        + 0.05 * torch.randn(3, 400, 2, generator=g)                                            # (G, N, O=2)
    w, b = fit_linear(x, y, alpha=1.0)
    assert w.shape == (3, 6, 2) and b.shape == (3, 2)
    for i in range(3):
        for o in range(2):
            xc, yc = x[i].double(), y[i, :, o].double()
            want = torch.linalg.solve(xc.T @ xc + torch.eye(6, dtype=torch.float64), xc.T @ (yc - yc.mean()))
            assert torch.allclose(w[i, :, o].double(), want, atol=1e-4) and abs(float(b[i, o] - yc.mean())) < 1e-5

    def mse(p):   # written out: per MLP, gelu(x W1 + b1) W2 + b2
        pred = torch.stack([F.gelu(x[i] @ p["w1"][i] + p["b1"][i]) @ p["w2"][i] + p["b2"][i] for i in range(3)])
        assert torch.allclose(pred, mlp_forward(p, x), atol=1e-5)
        return float(((pred - y) ** 2).mean())
    before, after = mse(fit_mlp(x, y, hidden=16, epochs=0)), mse(fit_mlp(x, y, hidden=16, epochs=15, batch_size=64))
    linear = float(((x @ w + b[:, None] - y) ** 2).mean())
    assert after < 0.5 * before and after < linear


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def attention_inputs(model, ids, past=None):
    """The hidden states entering each layer's attention in a vanilla forward of ``ids`` (after ``past``): each
    decoder layer's input through its ``input_layernorm`` ([B, q, D] per layer), and the forward's cache."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, output_hidden_states=True, **{cache_keyword(model): past})
        layers = model.model.layers
        return [layers[i].input_layernorm(out.hidden_states[i]) for i in range(len(layers))], out


def test_training_targets_are_the_kvzip_rules_scores_and_inputs_the_attention_inputs(model):
    ids = token_ids(1, 40, seed=3)
    prompt = prompt_params(Tok())
    x, y = text_samples(model, ids, prompt, positions=20, seed=0, run_probe=run_probe)
    pick = (torch.randperm(40 - SINK, generator=torch.Generator().manual_seed(0))[:20] + SINK).sort().values
    states = run_probe(model, "kvzip", dict(prompt), ids)
    hidden, _ = attention_inputs(model, ids)
    assert x.shape == (2, 20, 64) and y.shape == (2, 2, 20)
    for layer in range(2):
        assert torch.allclose(y[layer], states[layer].scores[0, :, pick].clamp_min(1e-9).log(), atol=1e-6)
        assert torch.allclose(x[layer].float(), hidden[layer][0, pick], rtol=2e-3, atol=2e-3)


def test_training_resumes_from_its_checkpoint_and_lowers_the_validation_loss(model, tmp_path):
    batches = [token_ids(1, 48, seed=i) for i in range(5)]
    lines = []
    s = train_kvzap(model, batches, tokenizer=Tok(), positions=30, epochs=15, batch_size=16,
                    checkpoint=str(tmp_path / "ck"), progress=lines.append, run_probe=run_probe)
    assert len(list((tmp_path / "ck").iterdir())) == 5
    assert any("text 5/5" in line and "left" in line for line in lines)
    untrained = train_kvzap(model, batches, tokenizer=Tok(), positions=30, epochs=0, checkpoint=str(tmp_path / "ck"),
                            progress=lines.append, run_probe=run_probe)
    assert any("from the checkpoint" in line for line in lines)
    x, y, _ = collect(model, batches, prompt_params(Tok()), positions=30, seed=0, checkpoint=None, progress=None,
                      run_probe=run_probe)
    again, _, _ = collect(model, batches, prompt_params(Tok()), positions=30, seed=0, checkpoint=str(tmp_path / "ck"),
                          progress=None, run_probe=run_probe)
    assert torch.equal(x, again)

    def mse(surrogate, kind):
        return sum(float(((surrogate.predict(i, x[i][None].float(), surrogate=kind)[0] - y[i]) ** 2).mean())
                   for i in range(2))
    assert mse(s, "mlp") < 0.8 * mse(untrained, "mlp")
    assert mse(s, "linear") <= mse(s, "mlp") * 1.5 and torch.equal(s.lin_w, untrained.lin_w)
    assert s.hidden == 64 // 8 and s.lin_w.shape == (2, 64, 2) and s.mlp_w2.shape == (2, 8, 2)


def test_surrogate_file_round_trips_and_refuses_another_model(model, tmp_path):
    fp = geometry_of_model(model).fingerprint
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=fp)
    path = tmp_path / "m.kvzap.safetensors"
    s.save(path)
    back = KVzapSurrogate.load(path)
    assert all(torch.equal(getattr(back, n), getattr(s, n)) for n in ("feat_mean", "lin_w", "mlp_w1", "mlp_w2"))
    back.check_model(model)
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=1, vocab=130)
    with pytest.raises(ProfileError) as err:
        back.check_model(other)
    msg = str(err.value)
    assert str(path) in msg and fp in msg and geometry_of_model(other).fingerprint in msg and "\n" not in msg
    assert "polykv model-data" in msg


def _plan(model, **op):
    return polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzap", **op), decode="full")


def test_the_rule_runs_through_apply_and_frees_memory(model):
    s = train_kvzap(model, [token_ids(1, 48, seed=i) for i in range(3)], tokenizer=Tok(), positions=30, epochs=2,
                    run_probe=run_probe)
    prompt = token_ids(1, 64, seed=11)
    got = {}
    for name, op in {"full": dict(capacity=64), "fixed": dict(capacity=16),
                     "threshold": dict(capacity=32, params={"threshold": -1e6, "window": 4})}.items():
        with polykv.apply(model, _plan(model, **op), model_data={"kvzap": s}) as session:
            session.prefill(prompt)
            got[name] = (session.resident_bytes().total, [layer.head_counts().tolist() for layer in session.cache.layers])
    assert got["fixed"][1] == [[[16, 16]]] * 2 and got["fixed"][0] * 4 == got["full"][0]
    assert got["threshold"][1] == [[[32, 32]]] * 2 and got["threshold"][0] * 2 == got["full"][0]
    tau = float(s.predict(0, attention_inputs(model, prompt)[0][0], surrogate="mlp")[..., 4:60].quantile(0.75))
    with polykv.apply(model, _plan(model, capacity=32, params={"threshold": tau, "window": 4}),
                      model_data={"kvzap": s}) as session:
        session.prefill(prompt)
        counts = session.cache.layers[0].head_counts()
    assert 8 < int(counts.min()) and int(counts.max()) < 32                      # input-adaptive, under the ceiling


def test_global_allocation_ranks_the_predicted_scores_over_layers_and_heads(model):
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=geometry_of_model(model).fingerprint)
    plan = attrs.evolve(_plan(model, capacity=16), allocation=(AllocationGroup(allocator="kvzap", layers=(0, 1)),))
    prompt = token_ids(1, 64, seed=12)
    with polykv.apply(model, plan, model_data={"kvzap": s}) as session:
        session.prefill(prompt)
        report = session.cache.allocations()
    budgets = torch.tensor([report[i]["budget"] for i in (0, 1)])                 # (layers, Hkv)
    hidden = attention_inputs(model, prompt)[0]
    scores = torch.stack([s.predict(i, hidden[i]) for i in (0, 1)])[:, 0]         # (layers, Hkv, T)
    scores[..., :4] = math.inf                                                    # the sinks rank first
    threshold = scores.flatten().topk(2 * 2 * 16).values[-1]
    want = (scores >= threshold).sum(-1)
    assert int(budgets.sum()) == 64 and int((budgets - want).abs().sum()) <= 2   # a near-tie may swap one token
    assert int(budgets.max()) > 16 > int(budgets.min())                           # heads beyond and below the mean


def test_the_registry_lists_rule_and_allocator():
    registry = Registry(load_entry_points=False)
    assert registry.rule("kvzap") is KVzapRule and registry.allocator("kvzap") is KVzapAllocator
    assert registry.rule("kvzap").model_data_need.key == "kvzap"


def test_gemma3_trains_and_serves():
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    gemma = random_model(cfg)
    s = train_kvzap(gemma, [token_ids(1, 40, seed=i) for i in range(3)], tokenizer=Tok(), positions=20, epochs=2,
                    run_probe=run_probe)
    assert (s.num_layers, s.num_kv_heads, s.hidden_size, s.hidden) == (2, 1, 64, 8)
    x, _ = text_samples(gemma, token_ids(1, 40, seed=0), prompt_params(Tok()), positions=20, seed=0, run_probe=run_probe)
    hidden = attention_inputs(gemma, token_ids(1, 40, seed=0))[0]                 # the normed (scaled) input
    pick = (torch.randperm(36, generator=torch.Generator().manual_seed(0))[:20] + SINK).sort().values
    assert torch.allclose(x[1].float(), hidden[1][0, pick], rtol=2e-3, atol=2e-3)
    plan = polykv.per_layer_plan(geometry_of_model(gemma), [{}, {"prefill": OpSpec(rule="kvzap", capacity=10)}])
    with polykv.apply(gemma, plan, model_data={"kvzap": s}) as session:
        session.prefill(token_ids(1, 40, seed=5))
        assert session.cache.layers[1].head_counts().tolist() == [[10]]


def test_in_decode_each_new_token_is_predicted_once_and_the_cache_stays_within_capacity_and_slack(model):
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=geometry_of_model(model).fingerprint)
    plan = polykv.uniform_plan(geometry_of_model(model), prefill="full",
                               decode=OpSpec(rule="kvzap", capacity=12, params={"window": 2}))
    plan = attrs.evolve(plan, trigger=attrs.evolve(plan.trigger, decode_slack=3))
    predicted = []
    original = KVzapSurrogate.predict

    def counting(self, layer_idx, hidden, **kw):
        predicted.append(hidden.shape[1])
        return original(self, layer_idx, hidden, **kw)
    KVzapSurrogate.predict = counting
    try:
        with polykv.apply(model, plan, model_data={"kvzap": s}) as session:
            calls.generate(session, token_ids(1, 20, seed=13), max_new_tokens=12, do_sample=False)
            counts = [layer.head_counts() for layer in session.cache.layers]
    finally:
        KVzapSurrogate.predict = original
    assert all(int(c.max()) <= 12 + 3 for c in counts)
    # one prediction per layer and forward, each of the forward's new tokens only (12 forwards: the prompt + 11)
    assert predicted == [20, 20] + [1, 1] * 11


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_rule_sees_the_hidden_states_entering_attention_in_prefill_and_decode(family):
    tiny = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16)
    ids, nxt = token_ids(1, 24, seed=4), token_ids(1, 1, seed=5)
    want, out = attention_inputs(tiny, ids)                                       # vanilla: no polykv
    want_step, _ = attention_inputs(tiny, nxt, out.past_key_values)
    seen = []
    original = PredictedScores.observe

    def recording(self, obs):
        seen.append((obs.layer_idx, obs.phase, obs.attention_input.clone()))
        return original(self, obs)
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=geometry_of_model(tiny).fingerprint)
    plan = polykv.uniform_plan(geometry_of_model(tiny), prefill=OpSpec(rule="kvzap", capacity=64),
                               decode=OpSpec(rule="kvzap", capacity=64))
    PredictedScores.observe = recording
    try:
        with torch.no_grad(), polykv.apply(tiny, plan, model_data={"kvzap": s}) as session:
            cache = session.new_cache()
            tiny(ids, use_cache=True, **{session.cache_keyword: cache})
            tiny(nxt, use_cache=True, **{session.cache_keyword: cache})
    finally:
        PredictedScores.observe = original
    assert [(i, p) for i, p, _ in seen] == [(0, "prefill"), (1, "prefill"), (0, "decode"), (1, "decode")]
    for (layer, phase, got), ref in zip(seen, [*want, *want_step]):
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5), (layer, phase)


def test_plans_without_a_rule_that_reads_the_attention_input_install_no_hook(model):
    def hooks():
        return sum(len(m._forward_pre_hooks) for m in model.modules())
    before = hooks()
    snap = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=12),
                               decode=OpSpec(rule="h2o", capacity=8))
    with polykv.apply(model, snap) as session:
        session.prefill(token_ids(1, 20))
        assert hooks() == before and session.attention_inputs.handles == {}
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=geometry_of_model(model).fingerprint)
    per_layer = polykv.per_layer_plan(geometry_of_model(model), [{}, {"prefill": OpSpec(rule="kvzap", capacity=10)}])
    with polykv.apply(model, per_layer, model_data={"kvzap": s}) as session:
        session.prefill(token_ids(1, 20))
        session.prefill(token_ids(1, 20))                                        # a second cache: hooked once
        assert hooks() == before + 1 and list(session.attention_inputs.handles) == [1]   # the kvzap layer only
        assert session.attention_inputs.held == {}                             # each step took its own
    assert hooks() == before                                                      # removed on exit


def test_a_prefill_snapshot_restores_what_the_plans_own_prefill_keeps(model):
    s = random_surrogate(L=2, Hkv=2, D=64, fingerprint=geometry_of_model(model).fingerprint)
    plan = attrs.evolve(_plan(model, capacity=16), allocation=(AllocationGroup(allocator="kvzap", layers=(0, 1)),))
    prompt = token_ids(1, 48, seed=14)
    snap = capture_prefill(model, prompt, [plan], model_data={"kvzap": s})
    with polykv.apply(model, plan, model_data={"kvzap": s}) as session:
        session.prefill(prompt)
        want = [layer.positions.tolist() for layer in session.cache.layers]
        restored = restore_prefill(session, snap)
        assert [layer.positions.tolist() for layer in restored.layers] == want
