"""TriAttention: query statistics on a tiny Llama, post-RoPE = pre-RoPE score, selection = definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polykv.adapters.rules.triattention import TriAttentionRule
from polykv.errors import ProfileError
from polykv.contract.rules import SelectionContext
from polykv.adapters.rules.query_stats import QueryStats, compute_query_stats
from polykv.testing import tiny_model
from polykv.runtime.cache import output_cache

OFFSETS = [2 ** j for j in range(17)]


def direct_queries(model, ids, layer):
    """Pre-RoPE queries [B, T, H, d] of ``layer`` recomputed from the layer's input hidden state."""
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    block = model.model.layers[layer]
    attn = block.self_attn
    h = block.input_layernorm(out.hidden_states[layer])
    B, T = ids.shape
    q = attn.q_proj(h).view(B, T, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    return q


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_query_stats_equal_direct_means(family):
    model = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 10), generator=g), torch.randint(0, 128, (1, 7), generator=g)]
    stats = compute_query_stats(model, batches)
    assert stats.mu_real.shape == (2, 4, 8) and stats.num_tokens == 27
    theta = model.config.rope_parameters["rope_theta"]
    assert torch.allclose(stats.inv_freq, torch.tensor([theta ** (-2 * i / 16) for i in range(8)]), rtol=1e-6)
    for layer in range(2):
        qs = torch.cat([direct_queries(model, b, layer).reshape(-1, 4, 16) for b in batches]).double()  # (N, H, d)
        re, im = qs[..., :8], qs[..., 8:]
        assert torch.allclose(stats.mu_real[layer].double(), re.mean(0), atol=1e-5)
        assert torch.allclose(stats.mu_imag[layer].double(), im.mean(0), atol=1e-5)
        assert torch.allclose(stats.mean_abs[layer].double(), (re ** 2 + im ** 2).sqrt().mean(0), atol=1e-5)
    stats.check_model(model)
    other = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16, seed=1)
    with pytest.raises(ProfileError, match="recompute"):
        stats.check_model(other)


def pre_rope_scores(mu, a, k_pre, pos, t0, inv_freq, s=1.0):
    """Paper form on pre-RoPE keys: mean_j sum_f s^2 |mu||k| cos(omega D_j + phi) + sum_f s^2 (a-|mu|)|k|.

    mu [F] complex, a [F], k_pre [T, F] complex, pos [T]; float64 numpy; returns [T].
    """
    out = np.zeros(len(pos))
    for t in range(len(pos)):
        trig = 0.0
        for delta in OFFSETS:
            D = t0 - pos[t] + delta
            for f in range(len(mu)):
                amp = abs(mu[f]) * abs(k_pre[t, f])
                phi = np.angle(mu[f] * np.conj(k_pre[t, f]))
                trig += s * s * amp * math.cos(D * inv_freq[f] + phi)
        norm = sum(s * s * (a[f] - abs(mu[f])) * abs(k_pre[t, f]) for f in range(len(mu)))
        out[t] = trig / len(OFFSETS) + norm
    return out


def unrotate(k_post, pos, inv_freq):
    """Invert RoPE at each key's position: k_f = k~_f exp(-i omega_f p). k_post [T, d] -> [T, d/2] complex."""
    F = k_post.shape[-1] // 2
    kc = k_post[:, :F] + 1j * k_post[:, F:]
    return kc * np.exp(-1j * np.outer(pos, inv_freq))


@torch.no_grad()
def test_post_rope_score_equals_pre_rope_score_on_tiny_llama():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(3)
    stats = compute_query_stats(model, [torch.randint(0, 128, (2, 16), generator=g)])
    ids = torch.randint(0, 128, (1, 20), generator=g)
    cache = output_cache(model(input_ids=ids, use_cache=True))
    inv = stats.inv_freq.double().numpy()
    rule = TriAttentionRule()
    for layer in range(2):
        k_post = cache.layers[layer].keys                               # (1, Hkv, T, d) post-RoPE
        k_direct = model.model.layers[layer].self_attn.k_proj(
            model.model.layers[layer].input_layernorm(
                model(input_ids=ids, output_hidden_states=True).hidden_states[layer])).view(1, 20, 2, 16)
        pos = np.arange(20)
        for t0 in (20, 5000):  # keys long in the past too
            ctx = SelectionContext(layer_idx=layer, phase="decode", keys=k_post,
                                   positions=torch.arange(20).expand(1, 2, 20), tokens_seen=t0, scaling=0.25,
                                   rope_inv_freq=stats.inv_freq, model_data={"triattention": stats})
            got = rule.head_scores(ctx)                                  # (1, Hkv, G, T)
            mu, a = stats.layer(layer)
            for kv in range(2):
                k_pre = unrotate(k_post[0, kv].double().numpy(), pos, inv)
                direct = k_direct[0, :, kv].double().numpy()
                assert np.allclose(k_pre, direct[:, :8] + 1j * direct[:, 8:], atol=1e-5)  # RoPE inverted
                for gq in range(2):
                    h = kv * 2 + gq
                    want = pre_rope_scores(mu[h].numpy().astype(np.complex128), a[h].double().numpy(), k_pre,
                                           pos, t0, inv)
                    assert np.allclose(got[0, kv, gq].double().numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def synthetic_stats(L=2, H=4, d=8, seed=0, theta=100.0):
    g = torch.Generator().manual_seed(seed)
    mu_r, mu_i = torch.randn(L, H, d // 2, generator=g), torch.randn(L, H, d // 2, generator=g)
    a = torch.complex(mu_r, mu_i).abs() + torch.rand(L, H, d // 2, generator=g)
    inv = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float32)
    return QueryStats(mu_real=mu_r, mu_imag=mu_i, mean_abs=a, inv_freq=inv, fingerprint="cfg-000000000000")


@pytest.mark.parametrize("capacity,gaps,layer,max_offset", [
    (1, False, 0, 65536), (6, True, 1, 65536), (11, True, 0, 65536), (5, False, 1, 8),
])
def test_triattention_selection_matches_definition(make_ctx, top, capacity, gaps, layer, max_offset):
    stats = synthetic_stats()
    ctx = make_ctx(T=12, d=8, gaps=gaps, layer_idx=layer, model_data={"triattention": stats}, phase="decode")
    ctx.rope_scaling = 1.3
    got = TriAttentionRule(max_offset=max_offset).select(ctx, capacity)
    global OFFSETS
    saved, OFFSETS = OFFSETS, [o for o in OFFSETS if o <= max_offset]
    try:
        inv = stats.inv_freq.double().numpy()
        for b in range(2):
            for kv in range(2):
                pos = ctx.positions[b, kv].numpy()
                k_pre = unrotate(ctx.keys[b, kv].double().numpy(), pos, inv)
                best = np.full(12, -np.inf)
                for gq in range(2):
                    h = kv * 2 + gq
                    mu = (stats.mu_real[layer, h].double() + 1j * stats.mu_imag[layer, h].double()).numpy()
                    s = pre_rope_scores(mu, stats.mean_abs[layer, h].double().numpy(), k_pre, pos,
                                        ctx.tokens_seen, inv, s=1.3)
                    best = np.maximum(best, (s - s.mean()) / s.std())
                assert got[b, kv].tolist() == top(best.tolist(), capacity)
    finally:
        OFFSETS = saved


def test_missing_or_mismatched_stats_are_errors(make_ctx):
    ctx = make_ctx(T=12, d=8)
    with pytest.raises(ValueError, match="compute_query_stats"):
        TriAttentionRule().select(ctx, 4)
    stats = synthetic_stats()
    ctx = make_ctx(T=12, d=8, model_data={"triattention": stats})
    ctx.rope_inv_freq = stats.inv_freq * 1.01
    with pytest.raises(ProfileError, match="RoPE frequencies"):
        TriAttentionRule().select(ctx, 4)
    ctx = make_ctx(T=12, d=8, layer_idx=5, model_data={"triattention": stats})
    with pytest.raises(ProfileError, match="layer 5"):
        TriAttentionRule().select(ctx, 4)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_stats_file_round_trip(tmp_path, suffix):
    stats = synthetic_stats()
    path = tmp_path / ("stats" + suffix)
    stats.save(path)
    back = QueryStats.load(path)
    for name in ("mu_real", "mu_imag", "mean_abs", "inv_freq"):
        assert torch.equal(getattr(back, name), getattr(stats, name))
    assert (back.fingerprint, back.num_tokens, back.attention_scaling) == (stats.fingerprint, 0, 1.0)
    with pytest.raises(ProfileError, match=r"\.safetensors or \.npz"):
        stats.save(tmp_path / "stats.bin")
    with pytest.raises(ProfileError, match="no such query statistics file"):
        QueryStats.load(tmp_path / ("missing" + suffix))


def test_ragged_padding_does_not_change_a_heads_ranking():
    """In a ragged layer each head is z-scored over its own tokens: padding a head in front changes nothing."""
    import torch

    from polykv.adapters.rules.triattention import TriAttentionRule
    from polykv.contract.rules import SelectionContext

    g = torch.Generator().manual_seed(3)
    Hkv, d, T = 2, 8, 10
    stats = synthetic_stats(L=1, H=4, d=d, seed=3)
    keys = torch.randn(1, Hkv, T, d, generator=g)
    pos = torch.arange(T).expand(1, Hkv, T)
    rule = TriAttentionRule()
    plain = rule.score(SelectionContext(layer_idx=0, phase="decode", keys=keys, positions=pos, tokens_seen=T,
                                        scaling=0.3, model_data={"triattention": stats}))
    pad = 3                                                     # head 1 padded by 3 zero columns in front
    keys_p = torch.cat([torch.zeros(1, Hkv, pad, d), keys], dim=2)
    pos_p = torch.cat([torch.full((1, Hkv, pad), -1), pos], dim=2)
    valid = pos_p >= 0
    padded = rule.score(SelectionContext(layer_idx=0, phase="decode", keys=keys_p, positions=pos_p, tokens_seen=T,
                                         scaling=0.3, model_data={"triattention": stats}, valid=valid))
    assert torch.allclose(padded[..., pad:], plain, atol=1e-5)
