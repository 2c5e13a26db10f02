"""KVzap (rule and allocator ``kvzap``): the surrogate's forward against a loop over tokens, the selection (fixed
ratio and threshold) against hand-picked indices, training against the ``kvzip`` rule's own scores, the surrogate
file, and the rule running through ``polykv.apply`` with its memory freed."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.nn.functional as F
import transformers

import polykv
from polykv.adapters.rules.kvzap import KVzapAllocator, KVzapRule, PredictedScores
from polykv.adapters.rules.kvzap_model import KVzapSurrogate, features
from polykv.adapters.rules.kvzap_train import SINK, collect, fit_linear, fit_mlp, text_samples, train_kvzap
from polykv.adapters.rules.kvzip import prompt_params
from polykv.contract.rules import SelectionContext
from polykv.contract.state import Observation
from polykv.errors import ProfileError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec
from polykv.registry import Registry
from polykv.runtime import calls
from polykv.runtime.session import run_probe
from polykv.testing import random_model, tiny_model, token_ids


class Tok:
    """A tokenizer without a chat template whose ids fit the tiny models' vocabulary."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 97 for ch in text]


def random_surrogate(L=2, Hkv=2, d=8, h=5, seed=0, fingerprint=None) -> KVzapSurrogate:
    g = torch.Generator().manual_seed(seed)
    Fd = 3 * d // 2

    def r(*shape):
        return torch.randn(*shape, generator=g)
    return KVzapSurrogate(feat_mean=r(L, Hkv, Fd), feat_std=r(L, Hkv, Fd).abs() + 0.5, lin_w=r(L, Hkv, Fd),
                          lin_b=r(L, Hkv), mlp_w1=r(L, Hkv, Fd, h), mlp_b1=r(L, Hkv, h), mlp_w2=r(L, Hkv, h),
                          mlp_b2=r(L, Hkv), fingerprint=fingerprint)


def loop_scores(s: KVzapSurrogate, layer: int, keys, values, kind: str, rope_scaling: float = 1.0) -> torch.Tensor:
    """The surrogate's score of every token, one token and head at a time, as the module docstring writes it."""
    B, Hkv, T, d = keys.shape
    out = torch.empty(B, Hkv, T, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                k, v = keys[b, h, t].double(), values[b, h, t].double()
                mags = [math.sqrt(float(k[f]) ** 2 + float(k[f + d // 2]) ** 2) / rope_scaling for f in range(d // 2)]
                phi = torch.tensor(mags + v.tolist(), dtype=torch.float64)
                x = (phi - s.feat_mean[layer, h].double()) / s.feat_std[layer, h].double()
                if kind == "linear":
                    out[b, h, t] = float(x @ s.lin_w[layer, h].double() + s.lin_b[layer, h])
                else:
                    hid = x @ s.mlp_w1[layer, h].double() + s.mlp_b1[layer, h].double()
                    out[b, h, t] = float(F.gelu(hid) @ s.mlp_w2[layer, h].double() + s.mlp_b2[layer, h])
    return out


def context(keys, values, *, model_data, layer=1, positions=None, **kw) -> SelectionContext:
    B, Hkv, T, _ = keys.shape
    pos = torch.arange(T).expand(B, Hkv, T) if positions is None else positions
    return SelectionContext(layer_idx=layer, phase="prefill", keys=keys, values=values, positions=pos, tokens_seen=T,
                            scaling=0.3, model_data=model_data, **kw)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_surrogate_forward_matches_a_loop_over_tokens_and_heads(kind):
    s = random_surrogate()
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    got = s.predict(1, keys, values, rope_scaling=1.5, surrogate=kind)
    assert got.shape == (2, 2, 7) and got.dtype == torch.float32
    assert torch.allclose(got.double(), loop_scores(s, 1, keys, values, kind, 1.5), atol=1e-4)


def test_key_features_are_the_same_before_and_after_rope():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    angle = torch.arange(9).view(9, 1) * (100.0 ** (-torch.arange(4) / 4.0)).view(1, 4) + 0.7     # (T, d/2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = k * cos + torch.cat([-k[..., 4:], k[..., :4]], -1) * sin                               # rotate_half
    assert torch.allclose(features(rotated, v), features(k, v), atol=1e-5)


def test_fixed_ratio_keeps_the_top_scores_per_head_after_the_sinks():
    s = random_surrogate(seed=2)
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    ctx = context(keys, values, model_data={"kvzap": s})
    scores = loop_scores(s, 1, keys, values, "mlp")[0]                                              # (Hkv, T)
    idx = KVzapRule(n_sink=2).select(ctx, 5)
    for h in range(2):
        rest = (scores[h, 2:].topk(3).indices + 2).tolist()
        assert idx[0, h].tolist() == sorted([0, 1] + rest)


def test_threshold_keeps_scores_above_tau_with_sinks_and_window_under_the_ceiling():
    s = random_surrogate(seed=5)
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    ctx = context(keys, values, model_data={"kvzap": s})
    scores = loop_scores(s, 1, keys, values, "linear")[0]
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


def test_scores_are_predicted_once_and_follow_the_stored_tokens():
    s = random_surrogate(seed=7)
    g = torch.Generator().manual_seed(8)
    keys, values = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    rule, state = KVzapRule(), PredictedScores("mlp")
    state.observe(Observation(layer_idx=1, phase="prefill", query=torch.zeros(1, 4, 10, 8), keys=keys,
                              positions=torch.arange(10).expand(1, 2, 10), valid=None, first_position=0, scaling=0.3))
    ctx = context(keys, values, model_data={"kvzap": s}, state=state)
    first = rule.score(ctx).clone()
    assert torch.allclose(first.double(), loop_scores(s, 1, keys, values, "mlp"), atol=1e-4)
    calls = []
    again = state.filled(ctx, lambda start: calls.append(start))          # nothing left to predict
    assert calls == [] and torch.equal(again, first)


def test_ridge_is_the_closed_form_and_the_mlp_lowers_its_loss():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 400, 6, generator=g)
    y = torch.sin(x[..., 0]) * 2 + x[..., 1] ** 2 - 1 + 0.05 * torch.randn(3, 400, generator=g)
    w, b = fit_linear(x, y, alpha=1.0)
    for i in range(3):
        xc = x[i].double()
        want = torch.linalg.solve(xc.T @ xc + torch.eye(6, dtype=torch.float64), xc.T @ (y[i].double() - y[i].mean()))
        assert torch.allclose(w[i].double(), want, atol=1e-4) and abs(float(b[i] - y[i].mean())) < 1e-5

    def mse(p):
        pred = (F.gelu(torch.baddbmm(p["b1"][:, None], x, p["w1"])) * p["w2"][:, None]).sum(-1) + p["b2"][:, None]
        return float(((pred - y) ** 2).mean())
    before, after = mse(fit_mlp(x, y, hidden=16, epochs=0)), mse(fit_mlp(x, y, hidden=16, epochs=15, batch_size=64))
    linear = float(((torch.einsum("gnf,gf->gn", x, w) + b[:, None] - y) ** 2).mean())
    assert after < 0.5 * before and after < linear


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def test_training_targets_are_the_kvzip_rules_scores_and_features_those_of_the_stored_keys(model):
    ids = token_ids(1, 40, seed=3)
    prompt = prompt_params(Tok())
    x, y = text_samples(model, ids, prompt, positions=20, seed=0, run_probe=run_probe)
    pick = (torch.randperm(40 - SINK, generator=torch.Generator().manual_seed(0))[:20] + SINK).sort().values
    states = run_probe(model, "kvzip", dict(prompt), ids)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values                   # post-RoPE keys, as stored
    assert x.shape == (2, 2, 20, 24) and y.shape == (2, 2, 20)
    for layer in range(2):
        assert torch.allclose(y[layer], states[layer].scores[0, :, pick].clamp_min(1e-9).log(), atol=1e-6)
        k, v = cache.layers[layer].keys, cache.layers[layer].values
        assert torch.allclose(x[layer].float(), features(k[:, :, pick], v[:, :, pick])[0], rtol=2e-3, atol=2e-3)


def test_training_resumes_from_its_checkpoint_and_lowers_the_validation_loss(model, tmp_path):
    batches = [token_ids(1, 48, seed=i) for i in range(5)]
    lines = []
    s = train_kvzap(model, batches, tokenizer=Tok(), positions=30, epochs=15, batch_size=16, checkpoint=str(tmp_path / "ck"),
                    progress=lines.append, run_probe=run_probe)
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
        return sum(float(((surrogate.predict_features(i, x[i][None].float(), kind)[0] - y[i]) ** 2).mean())
                   for i in range(2))
    assert mse(s, "mlp") < 0.8 * mse(untrained, "mlp")
    assert mse(s, "linear") <= mse(s, "mlp") * 1.5 and torch.equal(s.lin_w, untrained.lin_w)


def test_surrogate_file_round_trips_and_refuses_another_model(model, tmp_path):
    fp = geometry_of_model(model).fingerprint
    s = random_surrogate(L=2, Hkv=2, d=16, fingerprint=fp)
    path = tmp_path / "m.kvzap.safetensors"
    s.save(path)
    back = KVzapSurrogate.load(path)
    assert all(torch.equal(getattr(back, n), getattr(s, n)) for n in ("feat_mean", "lin_w", "mlp_w1", "mlp_b2"))
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
    tau = float(s.predict(0, *_stored(model, prompt, 0), surrogate="mlp")[..., 4:60].quantile(0.75))
    with polykv.apply(model, _plan(model, capacity=32, params={"threshold": tau, "window": 4}),
                      model_data={"kvzap": s}) as session:
        session.prefill(prompt)
        counts = session.cache.layers[0].head_counts()
    assert 8 < int(counts.min()) and int(counts.max()) < 32                      # input-adaptive, under the ceiling


def _stored(model, prompt, layer):
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    return cache.layers[layer].keys, cache.layers[layer].values


def test_global_allocation_ranks_the_predicted_scores_over_layers_and_heads(model):
    s = random_surrogate(L=2, Hkv=2, d=16, fingerprint=geometry_of_model(model).fingerprint)
    plan = attrs.evolve(_plan(model, capacity=16), allocation=(AllocationGroup(allocator="kvzap", layers=(0, 1)),))
    prompt = token_ids(1, 64, seed=12)
    with polykv.apply(model, plan, model_data={"kvzap": s}) as session:
        session.prefill(prompt)
        report = session.cache.allocations()
    budgets = torch.tensor([report[i]["budget"] for i in (0, 1)])                 # (layers, Hkv)
    scores = torch.stack([s.predict(i, *_stored(model, prompt, i)) for i in (0, 1)])[:, 0]   # (layers, Hkv, T)
    scores[..., :4] = math.inf                                                    # the sinks rank first
    threshold = scores.flatten().topk(2 * 2 * 16).values[-1]
    want = (scores >= threshold).sum(-1)
    assert int(budgets.sum()) == 64 and int((budgets - want).abs().sum()) <= 2   # a near-tie may swap one token
    assert int(budgets.max()) > 32                                                # a head beyond the per-head mean


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
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.hidden) == (2, 1, 16, 8)
    x, _ = text_samples(gemma, token_ids(1, 40, seed=0), prompt_params(Tok()), positions=20, seed=0, run_probe=run_probe)
    stored = _stored(gemma, token_ids(1, 40, seed=0), 1)                          # k_norm'ed, post-RoPE keys
    pick = (torch.randperm(36, generator=torch.Generator().manual_seed(0))[:20] + SINK).sort().values
    assert torch.allclose(x[1].float(), features(stored[0][:, :, pick], stored[1][:, :, pick])[0], rtol=2e-3, atol=2e-3)
    plan = polykv.per_layer_plan(geometry_of_model(gemma), [{}, {"prefill": OpSpec(rule="kvzap", capacity=10)}])
    with polykv.apply(gemma, plan, model_data={"kvzap": s}) as session:
        session.prefill(token_ids(1, 40, seed=5))
        assert session.cache.layers[1].head_counts().tolist() == [[10]]


def test_in_decode_each_new_token_is_predicted_once_and_the_cache_stays_within_capacity_and_slack(model):
    s = random_surrogate(L=2, Hkv=2, d=16, fingerprint=geometry_of_model(model).fingerprint)
    plan = polykv.uniform_plan(geometry_of_model(model), prefill="full",
                               decode=OpSpec(rule="kvzap", capacity=12, params={"window": 2}))
    plan = attrs.evolve(plan, trigger=attrs.evolve(plan.trigger, decode_slack=3))
    predicted = []
    original = KVzapRule.predict

    def counting(self, ctx, first=0):
        out = original(self, ctx, first)
        predicted.append(out.shape[-1])
        return out
    KVzapRule.predict = counting
    try:
        with polykv.apply(model, plan, model_data={"kvzap": s}) as session:
            calls.generate(session, token_ids(1, 20, seed=13), max_new_tokens=12, do_sample=False)
            counts = [layer.head_counts() for layer in session.cache.layers]
    finally:
        KVzapRule.predict = original
    assert all(int(c.max()) <= 12 + 3 for c in counts)
    # several selections per layer, yet no token predicted twice (rescoring would predict 12+ tokens each time)
    assert len(predicted) >= 2 * 3 and sum(predicted) <= 2 * (20 + 12)
