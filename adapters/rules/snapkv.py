"""SnapKV: observation-window voting with 1-D pooling, applied once to the prompt.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469). Reference code: https://github.com/FasterDecoding/SnapKV.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from polykv.contract import ScoredRule, SelectionContext, newest_tokens, param


class SnapKVRule(ScoredRule):
    """Keep the whole observation window plus the top ``capacity - window`` prefix tokens per KV head.

    The window is the last ``window`` stored prompt tokens, whose queries vote. For a prefix token
    j (not in the window), ``vote[h, j] = sum over window queries i of softmax_j(q_i . k_j * scaling)``
    (the softmax runs over every stored key visible to query i, window included); the votes are
    averaged over the G query heads of each KV head, then smoothed along tokens with a 1-D
    ``pooling`` pool (kernel ``kernel_size``, stride 1, padding ``kernel_size // 2``; the average
    pool counts the zero padding, as in the reference). When ``capacity <= window`` the last
    ``capacity`` tokens are kept. Prefill only.

    Parameters
    ----------
    window : int, default 32
        Observation window (reference ``window_size=32``).
    kernel_size : int, default 7
        Pooling kernel, odd (reference ``kernel_size=7``).
    pooling : {"max", "avg"}, default "max"
        Pooling of the votes (reference ``pooling='maxpool'``).
    """

    name = "snapkv"
    phases = frozenset({"prefill"})
    signal = "observation_window"
    window: int = param(32, low=1, high=1 << 20, description="observation window in tokens")
    kernel_size: int = param(7, low=1, high=1 << 12, odd=True, description="pooling kernel")
    pooling: str = param("max", choices=("max", "avg"), description="pooling of the votes")
    shared_across_heads = False
    paper = ("Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 "
             "(arXiv:2404.14469)")

    def _window(self, ctx: SelectionContext) -> int:
        return min(int(self.window), ctx.num_stored)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Pooled votes of the prefix, +inf on the window: [B, Hkv, T] float32."""
        k, pooling = int(self.kernel_size), self.pooling
        if ctx.queries is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'snapkv' needs the last {self.window} "
                f"queries (ctx.queries); the runtime must keep signal '{self.signal}' for this layer"
            )
        w = self._window(ctx)
        if ctx.queries.shape[2] < w:
            raise ValueError(
                f"layer {ctx.layer_idx}: rule 'snapkv' has window {w} but the context carries only "
                f"{ctx.queries.shape[2]} queries; the runtime must pass the last {w} prompt queries"
            )
        B, Hkv, T = ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored
        attn = ctx.window_attention(w)                                   # (B, H, w, T)
        votes = attn[..., : T - w].sum(dim=2)                            # (B, H, T-w)
        votes = votes.view(B, Hkv, -1, T - w).mean(dim=2)                # (B, Hkv, T-w)
        if T - w > 0:
            flat = votes.reshape(B * Hkv, 1, T - w)
            pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
            votes = pool(flat, kernel_size=k, stride=1, padding=k // 2).view(B, Hkv, T - w)
        window_scores = votes.new_full((B, Hkv, w), math.inf)
        return torch.cat([votes, window_scores], dim=-1)                # (B, Hkv, T)

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor:
        """[B, Hkv, capacity] kept indices; the last ``capacity`` tokens when the window fills it."""
        if capacity <= self._window(ctx):
            return newest_tokens(ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored, capacity, ctx.keys.device)
        return super().select(ctx, capacity)

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        """(0, window): the observation window is always kept (truncated to the capacity)."""
        return 0, self._window(ctx)
