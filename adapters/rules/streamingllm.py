"""StreamingLLM: attention sinks plus a recent window.

Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024 (arXiv:2309.17453). Reference code: https://github.com/mit-han-lab/streaming-llm.
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, ScoredRule, SelectionContext, param


class StreamingLLMRule(ScoredRule):
    """Keep the first ``n_sink`` stored tokens and the most recent ``capacity - n_sink``.

    Keys stay post-RoPE with their *original* positions (the common Hugging Face variant); the
    original implementation stores pre-RoPE keys and re-rotates them with their slot positions
    inside the cache, which this rule does not do. When ``n_sink >= capacity`` only the first
    ``capacity`` tokens are kept. Needs no attention and no scores beyond storage order.

    Parameters
    ----------
    n_sink : int, default 4
        Attention-sink tokens kept at the start of storage (reference ``start_size=4``).
    """

    name = "streamingllm"
    phases = frozenset(PHASES)
    signal = "none"
    n_sink: int = param(4, low=0, high=1 << 20, description="attention-sink tokens kept")
    shared_across_heads = True
    paper = ("Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 "
             "(arXiv:2309.17453)")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Storage order as the score (newer = higher): [B, 1, T] float32.

        Combined with :meth:`protected` this keeps the sinks plus the newest tokens.
        """
        B, T = ctx.keys.shape[0], ctx.num_stored
        return torch.arange(T, device=ctx.keys.device, dtype=torch.float32).view(1, 1, T).expand(B, 1, T)

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        """(n_sink, capacity - n_sink): sinks first, the rest of the budget is the recent window."""
        n_sink = int(self.n_sink)
        if n_sink < 0:
            raise ValueError(f"rule 'streamingllm': n_sink must be >= 0, got {n_sink}")
        return n_sink, max(capacity - n_sink, 0)
