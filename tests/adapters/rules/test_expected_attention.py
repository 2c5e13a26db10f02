"""Expected Attention: score = a loop-by-loop reference, kept tokens = kvpress's scoring on a tiny Llama,
the future rotation at the real next position (chunked prefill, decode), the plugin contract."""

from __future__ import annotations

import math

import pytest
import torch

import polykv
from polykv.adapters.rules.adakv import AdaKVRule
from polykv.adapters.rules.expected_attention import ExpectedAttentionRule, QueryBuffer, QueryMoments
from polykv.contract.rules import SelectionContext
from polykv.contract.state import Observation
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.plugin_checks import check_rule
from polykv.testing import tiny_model, token_ids

# -- plain-Python reference -------------------------------------------------------------------------------


def rope(vec, p, inv):
    """RoPE ("half" pairing) of one vector at position p, loop by loop."""
    F = len(inv)
    out = [0.0] * (2 * F)
    for f in range(F):
        c, s = math.cos(p * inv[f]), math.sin(p * inv[f])
        out[f] = vec[f] * c - vec[f + F] * s
        out[f + F] = vec[f + F] * c + vec[f] * s
    return out


def reference_scores(qpre, keys, values, inv, t, *, n_f, n_sink, use_cov, use_vnorm, eps):
    """Expected-attention scores [Hkv][T] of one batch row, loop by loop in float64.

    qpre [H][N][d] pre-RoPE queries (the statistics' queries), keys/values [Hkv][T][d] post-RoPE;
    the average rotation over positions [t, t + n_f); the first n_sink stored columns get max + 1."""
    H, Hkv, T, d, F = len(qpre), len(keys), len(keys[0]), len(keys[0][0]), len(inv)
    G = H // Hkv
    cbar = [sum(math.cos(p * inv[f]) for p in range(t, t + n_f)) / n_f for f in range(F)]
    sbar = [sum(math.sin(p * inv[f]) for p in range(t, t + n_f)) / n_f for f in range(F)]
    R = [[0.0] * d for _ in range(d)]
    for f in range(F):
        R[f][f], R[f + F][f + F], R[f][f + F], R[f + F][f] = cbar[f], cbar[f], -sbar[f], sbar[f]
    out = []
    for kv in range(Hkv):
        probs = [[0.0] * T for _ in range(G)]
        for g in range(G):
            qs = qpre[kv * G + g]
            N = len(qs)
            mu = [sum(q[i] for q in qs) / N for i in range(d)]
            cov = [[sum((q[i] - mu[i]) * (q[j] - mu[j]) for q in qs) / N for j in range(d)] for i in range(d)]
            mu2 = [sum(R[i][a] * mu[a] for a in range(d)) for i in range(d)]
            cov2 = [[sum(R[i][a] * cov[a][b] * R[j][b] for a in range(d) for b in range(d)) for j in range(d)]
                    for i in range(d)]
            z = {}
            for j in range(n_sink, T):
                k = keys[kv][j]
                z[j] = sum(mu2[i] * k[i] for i in range(d)) / math.sqrt(d)
                if use_cov:
                    z[j] += sum(k[i] * cov2[i][b] * k[b] for i in range(d) for b in range(d)) / (2 * d)
            m = max(z.values())
            tot = sum(math.exp(v - m) for v in z.values())
            for j, v in z.items():
                probs[g][j] = math.exp(v - m) / tot
        row = []
        for j in range(T):
            s = sum(probs[g][j] for g in range(G)) / G
            if use_vnorm:
                s = (s + eps) * math.sqrt(sum(x * x for x in values[kv][j]))
            row.append(s)
        top = max(row[n_sink:]) + 1.0
        out.append([top if j < n_sink else row[j] for j in range(T)])
    return out


def _case(seed, *, B=2, H=4, Hkv=2, T=10, d=8, N=None):
    g = torch.Generator().manual_seed(seed)
    inv = [10.0 ** (-2 * i / d) for i in range(d // 2)]
    qpre = torch.randn(B, H, N or T, d, generator=g, dtype=torch.float64) + 0.5
    keys = torch.randn(B, Hkv, T, d, generator=g)
    values = torch.randn(B, Hkv, T, d, generator=g)
    return inv, qpre, keys, values


def _post(qpre, positions, inv):
    """Post-RoPE queries of ``qpre`` [B, H, N, d] at ``positions``, float32, by the loop reference."""
    B, H, N, _ = qpre.shape
    return torch.tensor([[[rope(qpre[b, h, n].tolist(), int(positions[n]), inv) for n in range(N)]
                          for h in range(H)] for b in range(B)], dtype=torch.float32)


FLAGS = [dict(), dict(use_covariance=False), dict(use_vnorm=False), dict(epsilon=0.3, n_sink=2),
         dict(n_sink=0, n_future_positions=7)]


@pytest.mark.parametrize("params", FLAGS)
@pytest.mark.parametrize("folded", [True, False])
def test_prefill_score_equals_loop_reference(params, folded):
    rule = ExpectedAttentionRule(**params)
    p = rule.params
    inv, qpre, keys, values = _case(1)
    T = keys.shape[2]
    state = rule.new_state()
    state.observe(Observation(layer_idx=0, phase="prefill", query=_post(qpre, range(T), inv), keys=keys,
                              positions=torch.arange(T).expand(2, 2, T), valid=None, first_position=0, scaling=1.0,
                              rope_inv_freq=torch.tensor(inv) if folded else None))
    assert (state.component(QueryMoments).count > 0) == folded   # without frequencies: folded at selection
    ctx = SelectionContext(layer_idx=0, phase="prefill", keys=keys, positions=torch.arange(T).expand(2, 2, T),
                           tokens_seen=T, scaling=1.0, values=values, rope_inv_freq=torch.tensor(inv), state=state,
                           queries=state.component(QueryBuffer).queries,
                           query_positions=state.component(QueryBuffer).positions)
    got = rule.score(ctx)
    for b in range(2):
        want = reference_scores(qpre[b, :, p["n_sink"]:].tolist(), keys[b].tolist(), values[b].tolist(), inv, T,
                                n_f=p["n_future_positions"], n_sink=p["n_sink"], use_cov=p["use_covariance"],
                                use_vnorm=p["use_vnorm"], eps=p["epsilon"])
        assert torch.allclose(got[b].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)


def test_decode_rotation_sits_at_the_next_real_position():
    """Decode scores from the buffer of recent queries, rotated from tokens_seen on (not from the buffer length,
    kvpress's offset, which gives other scores)."""
    rule = ExpectedAttentionRule(query_buffer=5, n_future_positions=16)
    inv, qpre, keys, values = _case(2, N=5)
    T = keys.shape[2]
    positions = torch.tensor([0, 1, 2, 3, 9, 15, 21, 27, 33, 38])
    qpos = torch.arange(34, 39)
    state = rule.new_state()
    state.observe(Observation(layer_idx=0, phase="decode", query=_post(qpre, qpos, inv), keys=keys,
                              positions=positions.expand(2, 2, T), valid=None, first_position=34, scaling=1.0,
                              rope_inv_freq=torch.tensor(inv)))
    buf = state.component(QueryBuffer)
    ctx = SelectionContext(layer_idx=0, phase="decode", keys=keys, positions=positions.expand(2, 2, T), tokens_seen=39,
                           scaling=1.0, values=values, rope_inv_freq=torch.tensor(inv), state=state,
                           queries=buf.queries, query_positions=buf.positions)
    got = rule.score(ctx)
    for b in range(2):
        args = (qpre[b].tolist(), keys[b].tolist(), values[b].tolist(), inv)
        kw = dict(n_f=16, n_sink=4, use_cov=True, use_vnorm=True, eps=0.0)
        want = torch.tensor(reference_scores(*args, 39, **kw), dtype=torch.float64)
        assert torch.allclose(got[b].double(), want, rtol=1e-4, atol=1e-6)
        quirk = torch.tensor(reference_scores(*args, 5, **kw), dtype=torch.float64)  # kvpress: [q_len, q_len + n_f)
        assert not torch.allclose(quirk, want, rtol=1e-2)


# -- kvpress's scoring, written out, on a tiny Llama -----------------------------------------------------


def kvpress_kept(model, ids, layer, capacity, n_future=512, n_sink=4):
    """Kept positions [Hkv, capacity] of ExpectedAttentionPress's scoring, as its code computes it."""
    captured = {}
    attn = model.model.layers[layer].self_attn
    hook = attn.register_forward_pre_hook(lambda m, a, kw: captured.update(h=kw["hidden_states"]), with_kwargs=True)
    try:
        out = model(ids, use_cache=True)
    finally:
        hook.remove()
    keys, values = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
    hidden = captured["h"]
    bsz, q_len, _ = hidden.shape
    n, d = model.config.num_attention_heads, attn.head_dim
    h = hidden[:, n_sink:]
    Wq = attn.q_proj.weight
    mean_h = h.mean(dim=1, keepdim=True)
    mu = torch.matmul(mean_h, Wq.T).squeeze(1).view(bsz, n, d)
    hc = h - mean_h
    cov = torch.matmul(hc.transpose(1, 2), hc) / hc.shape[1]
    cov = torch.matmul(Wq, torch.matmul(cov, Wq.T)).view(bsz, n, d, n, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
    cos, sin = model.model.rotary_emb(mu, torch.arange(q_len, q_len + n_future).unsqueeze(0))
    cos, sin = cos[0], sin[0]
    Id = torch.eye(d)
    P = torch.zeros(d, d)
    P[d // 2:, : d // 2], P[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    R = (cos.unsqueeze(1) * Id + sin.unsqueeze(1) * P).mean(dim=0)
    mu, cov = mu @ R.T, R @ cov @ R.T
    k, v = keys[:, :, n_sink:], values[:, :, n_sink:]
    Hkv = k.shape[1]
    kr = k.repeat_interleave(n // Hkv, dim=1).transpose(2, 3)
    scores = torch.matmul(mu.unsqueeze(2), kr).squeeze(2) / math.sqrt(d)
    scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", kr, cov, kr) / d / 2
    scores = torch.softmax(scores, dim=-1).view(bsz, Hkv, n // Hkv, -1).mean(2) * v.norm(dim=-1)
    scores = torch.nn.functional.pad(scores, (n_sink, 0), value=scores.max().item())
    return torch.sort(scores[0].topk(capacity, dim=-1).indices, dim=-1).values


def _kept(model, plan, ids, chunk_size=None):
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids, chunk_size=chunk_size)
        return [session.cache.layers[i].positions[0].clone() for i in range(model.config.num_hidden_layers)]


@torch.no_grad()
def test_kept_tokens_equal_kvpress_scoring_on_tiny_llama():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    ids = token_ids(1, 48, seed=5)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="expected-attention", capacity=16),
                               decode=OpSpec(rule="full"))
    got = _kept(model, plan, ids)
    for layer in range(2):
        want = kvpress_kept(model, ids, layer, 16)
        assert torch.equal(got[layer], want), (layer, got[layer], want)


@torch.no_grad()
def test_chunked_prefill_keeps_what_one_forward_keeps():
    """Moments over every chunk and the rotation at the prompt's end: chunking changes nothing (kvpress's
    statistics and rotation offset would follow the last chunk)."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    ids = token_ids(1, 50, seed=6)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="expected-attention", capacity=14,
                                                   params={"n_future_positions": 64}),
                               decode=OpSpec(rule="full"))
    whole = _kept(model, plan, ids)
    chunked = _kept(model, plan, ids, chunk_size=16)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


# -- the plugin contract ---------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [{}, {"use_covariance": False, "use_vnorm": False, "n_sink": 0, "query_buffer": 3}])
def test_check_rule_passes(params):
    calls = check_rule(ExpectedAttentionRule, params)
    assert calls["prefill"] and calls["decode"]


def test_adakv_over_expected_attention_gets_values():
    """kvpress's leaderboard entry: AdaKV(ExpectedAttention(epsilon=0.01))."""
    calls = check_rule(AdaKVRule, {"rule": "expected-attention", "rule_params": {"epsilon": 0.01}}, ragged=False)
    assert calls["prefill"]


def test_refuses_a_model_without_rope_frequencies(make_ctx):
    rule = ExpectedAttentionRule()
    ctx = make_ctx(T=12, d=8, phase="decode")
    ctx.state = rule.new_state()
    with pytest.raises(ValueError, match="RoPE frequencies"):
        rule.select(ctx, 6)
