"""Key-norm: keep the keys with the smallest L2 norm.

Devoto, Zhao, Scardapane, Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", EMNLP 2024 (arXiv:2406.11430); kvpress ``KnormPress`` (https://github.com/NVIDIA/kvpress).
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, ScoredRule, SelectionContext


class KeyNormRule(ScoredRule):
    """Keep, per KV head, the ``capacity`` stored keys with the lowest L2 norm.

    ``score[j] = -||k_j||_2`` over the head dimension of the stored (post-RoPE) key; RoPE is a
    rotation, so the norm equals the pre-RoPE key's norm. Needs no attention.
    """

    name = "key-norm"
    phases = frozenset(PHASES)
    signal = "none"
    defaults = {}
    shared_across_heads = False
    paper = ("Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, "
             "EMNLP 2024 (arXiv:2406.11430)")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Negative key norms: [B, Hkv, T] float32."""
        return -ctx.keys.float().norm(dim=-1)
