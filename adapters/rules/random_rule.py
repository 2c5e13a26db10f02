"""Random: keep a uniformly random subset per KV head (the control every rule must beat).

Used as the random-eviction baseline in, e.g., Zhang et al., H2O, NeurIPS 2023 (arXiv:2306.14048)
and kvpress's ``RandomPress`` (https://github.com/NVIDIA/kvpress).
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, ScoredRule, SelectionContext


class RandomRule(ScoredRule):
    """Keep ``capacity`` tokens drawn uniformly without replacement, independently per KV head.

    Scores are ``torch.rand`` draws from ``ctx.generator`` (the runtime's seeded generator), so a
    seeded run is reproducible. A context without a generator is an error, never an unseeded draw.
    """

    name = "random"
    phases = frozenset(PHASES)
    signal = "none"
    defaults = {}
    shared_across_heads = False
    paper = "Random-eviction baseline (Zhang et al., H2O, NeurIPS 2023, arXiv:2306.14048; kvpress RandomPress)"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Uniform draws in [0, 1): [B, Hkv, T] float32."""
        if ctx.generator is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'random' needs a seeded torch.Generator in "
                f"ctx.generator; the runtime must pass one (seed it from the run's seed)"
            )
        B, Hkv, T = ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored
        draws = torch.rand((B, Hkv, T), generator=ctx.generator, device=ctx.generator.device)
        return draws.to(ctx.keys.device)
