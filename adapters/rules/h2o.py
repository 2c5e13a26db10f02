"""H2O: heavy hitters (accumulated attention) plus a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (arXiv:2306.14048). Reference code: https://github.com/FMInference/H2O.
"""

from __future__ import annotations

import math

import torch

from polykv.contract import PHASES, ScoredRule, SelectionContext, param


class H2ORule(ScoredRule):
    """Keep the ``recent`` newest tokens plus the ``capacity - recent`` heaviest hitters, per KV head.

    The score of stored token j is its accumulated attention: the sum, over every query processed
    so far and over the G query heads of the KV head, of the softmax probability that query gave
    j (``ctx.accumulated``, [B, Hkv, T]). Variant: in prefill the runtime's accumulated sums are
    the column sums of the prompt's attention (the one-shot prefill variant); in decode they keep
    growing with every decode query and kept tokens carry their sums forward (the accumulating
    variant of the reference, which evicts at every step). With ``normalize=True`` each sum is
    divided by the number of queries that could see the token (``ctx.query_counts``), the usual
    correction for the bias towards old tokens.

    Parameters
    ----------
    recent_ratio : float, default 0.5
        Share of the capacity reserved for the most recent tokens: ``recent = floor(recent_ratio *
        capacity)``. The reference uses heavy = recent (10% of the length each), i.e. half the
        budget each.
    normalize : bool, default False
        Divide accumulated attention by the number of queries that saw each token.
    """

    name = "h2o"
    phases = frozenset(PHASES)
    signal = "accumulated_attention"
    recent_ratio: float = param(0.5, low=0.0, high=1.0,
                                description="share of the capacity kept for the most recent tokens")
    normalize: bool = param(False, description="divide accumulated attention by the query count")
    shared_across_heads = False
    paper = ("Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large "
             "Language Models, NeurIPS 2023 (arXiv:2306.14048)")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Accumulated (optionally count-normalised) attention: [B, Hkv, T] float32."""
        if ctx.accumulated is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'h2o' needs accumulated attention "
                f"(ctx.accumulated [B, Hkv, T]); the runtime must track signal '{self.signal}' for this layer"
            )
        acc = ctx.accumulated.float()
        if not self.normalize:
            return acc
        if ctx.query_counts is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'h2o' with normalize=True needs "
                f"ctx.query_counts [B, Hkv, T]; the runtime must count the queries that saw each token"
            )
        return acc / ctx.query_counts.float().clamp_min(1.0)

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        """(0, recent) with ``recent = floor(recent_ratio * capacity)``."""
        return 0, math.floor(float(self.recent_ratio) * capacity + 1e-9)  # guard 0.29 * 100 = 28.999...
