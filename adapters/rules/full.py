"""Full: keep every token (no compression); the identity of a plan's inactive phases.

Reference: the uncompressed KV cache of a standard decoder (Vaswani et al., "Attention Is All You
Need", NeurIPS 2017, arXiv:1706.03762).
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, RetentionRule, SelectionContext


class FullRule(RetentionRule):
    """Keep every stored token.

    A layer routed to ``full`` has unbounded capacity, so the runtime never asks it to select.
    Being asked anyway means the plan gave ``full`` a finite capacity below the stored length,
    which is a plan error: :meth:`select` raises instead of evicting anything.
    """

    name = "full"
    phases = frozenset(PHASES)
    signal = "none"
    defaults = {}
    shared_across_heads = False
    paper = "Vaswani et al., Attention Is All You Need, NeurIPS 2017 (arXiv:1706.03762)"

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor:
        """Never evicts: raises, naming the layer and the sizes involved.

        Parameters
        ----------
        ctx : SelectionContext
            ``ctx.keys`` is [B, Hkv, T, d].
        capacity : int
            The capacity the caller asked for (smaller than T).
        """
        raise ValueError(
            f"layer {ctx.layer_idx} ({ctx.phase}): rule 'full' keeps every token and cannot reduce "
            f"{ctx.num_stored} stored tokens to capacity {capacity}; give the layer no capacity "
            f"(unbounded) or route it to an eviction rule such as 'streamingllm'"
        )
