"""TriAttention: score stored keys with a trigonometric series built from offline query centers.

Mao et al., "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
arXiv:2604.04921 (2026). Reference code: https://github.com/WeianMao/triattention.
"""

from __future__ import annotations

import math

import torch

from polykv.contract import PHASES, ModelDataNeed, ScoredRule, SelectionContext, param
from polykv.adapters.rules.query_stats import QUERY_STATS_SUFFIX, QueryStats, compute_query_stats, is_query_stats_file

STATS_KEY = "triattention"

QUERY_STATISTICS = ModelDataNeed(
    key=STATS_KEY, suffix=QUERY_STATS_SUFFIX, compute=compute_query_stats, load=QueryStats.load,
    check=lambda stats, model: stats.check_model(model), recognise=is_query_stats_file,
    description="pre-RoPE query statistics")
"""What the rule needs measured on the model: calibration computes it over its sequences and saves it
beside the profile (``x.qstats.safetensors``); studies load that file or compute it."""


class TriAttentionRule(ScoredRule):
    """Keep, per KV head, the keys a typical future query is predicted to attend to most.

    Offline statistics per layer and query head (:mod:`polykv.adapters.rules.query_stats`) give the
    mean pre-RoPE query ``mu_f`` (complex, "half" pairing) and mean magnitude ``a_f`` per RoPE
    frequency f. For a stored post-RoPE key ``k~_f = k~[f] + i k~[f + d/2]`` the score of query head
    h is, with ``t_j = t0 + delta_j``, ``t0 = ctx.tokens_seen`` and ``delta_j = 1, 2, 4, ..., max_offset``::

        S_trig = mean_j sum_f s^2 Re(mu_f conj(k~_f) exp(i omega_f t_j))
        S_norm = sum_f s^2 (a_f - |mu_f|) |k~_f|
        score  = S_trig + S_norm

    which equals the paper's pre-RoPE form ``sum_f s^2 |mu_f||k_f| cos(omega_f D_j + phi_f)`` with
    ``D_j = t_j - p`` (p the key's original position) without inverting RoPE. Each query head's
    scores are z-scored over the stored tokens (a ragged layer's padding excluded); a KV head takes
    the max over its G query heads.
    Every stored token is a candidate (the reference's truncation of a long prompt to its first
    ``budget`` tokens is not reproduced). The reference prunes during decode every 128 steps;
    here the runtime's trigger slack sets the cadence, and prefill is supported too.

    ``ctx.model_data["triattention"]`` must hold a :class:`~polykv.adapters.rules.query_stats.QueryStats`
    measured on this model.

    Parameters
    ----------
    max_offset : int, default 65536
        Largest future offset; the offsets are the powers of two 1..max_offset (17 by default).
    """

    name = "triattention"
    phases = frozenset(PHASES)
    signal = "prerope_key_stats"
    max_offset: int = param(65536, low=1, high=1 << 31, description="largest future offset scored")
    shared_across_heads = False
    model_data_need = QUERY_STATISTICS
    paper = ("Mao et al., TriAttention: Efficient Long Reasoning with Trigonometric KV Compression, "
             "arXiv:2604.04921 (2026)")

    def offsets(self) -> list[int]:
        """The future offsets delta_j: powers of two from 1 to ``max_offset``."""
        m = int(self.max_offset)
        if m < 1:
            raise ValueError(f"rule 'triattention': max_offset must be >= 1, got {m}")
        return [2 ** j for j in range(int(math.log2(m)) + 1)]

    def _stats(self, ctx: SelectionContext):
        stats = ctx.model_data.get(STATS_KEY) if ctx.model_data is not None else None
        if stats is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'triattention' needs query statistics in "
                f"model_data['{STATS_KEY}']. Compute them once with "
                f"polykv.adapters.rules.query_stats.compute_query_stats(model, token_batches).save('stats.safetensors') "
                f"over any plain text, then pass QueryStats.load('stats.safetensors') to the runtime"
            )
        return stats

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Per-KV-head max of per-query-head z-scored trigonometric scores: [B, Hkv, T] float32."""
        score = self.head_scores(ctx)                                      # (B, Hkv, G, T)
        if ctx.valid is None:
            z = (score - score.mean(dim=-1, keepdim=True)) / (score.std(dim=-1, unbiased=False, keepdim=True) + 1e-6)
            return z.amax(dim=2)                                           # (B, Hkv, T)
        # Ragged layer: each head's statistics over its own tokens only (padding columns excluded).
        w = ctx.valid.unsqueeze(2).float()                                 # (B, Hkv, 1, T)
        n = w.sum(-1, keepdim=True).clamp_min(1.0)
        mean = (score * w).sum(-1, keepdim=True) / n
        std = (((score - mean) ** 2 * w).sum(-1, keepdim=True) / n).sqrt()
        return ((score - mean) / (std + 1e-6)).amax(dim=2)

    def head_scores(self, ctx: SelectionContext) -> torch.Tensor:
        """Raw ``S_trig + S_norm`` of every query head: [B, Hkv, G, T] float32 (query head = kv * G + g)."""
        stats = self._stats(ctx)
        B, Hkv, T, d = ctx.keys.shape
        if stats.head_dim != d or stats.num_heads % Hkv:
            raise ValueError(
                f"layer {ctx.layer_idx}: query statistics are for {stats.num_heads} query heads of dim "
                f"{stats.head_dim}, the layer stores {Hkv} KV heads of dim {d}; recompute them on this model"
            )
        if ctx.rope_inv_freq is not None:
            stats.check_inv_freq(ctx.rope_inv_freq, where=f"layer {ctx.layer_idx}")
        dev, F = ctx.keys.device, d // 2
        G = stats.num_heads // Hkv
        mu, mean_abs = stats.layer(ctx.layer_idx)                          # (H, F) complex, (H, F)
        mu, mean_abs = mu.to(dev), mean_abs.to(dev)
        k = ctx.keys.float()                                               # (B, Hkv, T, d) = [Re k~_f | Im k~_f]
        k_abs = torch.sqrt(k[..., :F] ** 2 + k[..., F:] ** 2)             # (B, Hkv, T, F) |k~_f|
        # Average of exp(i omega_f t_j) over the future offsets; angles reduced in float64.
        t = ctx.tokens_seen + torch.tensor(self.offsets(), dtype=torch.float64, device=dev)  # (J,)
        ang = torch.remainder(stats.inv_freq.to(dev, torch.float64)[None, :] * t[:, None], 2 * math.pi)
        rot = torch.polar(torch.ones_like(ang, dtype=torch.float32), ang.float()).mean(dim=0)  # (F,)
        s2 = float(ctx.rope_scaling) ** 2
        # Re(w conj(k~)) = Re(w) Re(k~) + Im(w) Im(k~): one real contraction over the stored layout.
        w = mu * rot                                                       # (H, F) complex
        weight = torch.cat([w.real, w.imag], dim=-1).view(Hkv, G, 2 * F)  # (Hkv, G, d)
        trig = torch.einsum("kgd,bktd->bkgt", weight, k)                  # (B, Hkv, G, T)
        spread = (mean_abs - mu.abs()).view(Hkv, G, F)                     # (Hkv, G, F)
        norm = torch.einsum("kgf,bktf->bkgt", spread, k_abs)             # (B, Hkv, G, T)
        return s2 * (trig + norm)
