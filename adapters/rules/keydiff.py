"""KeyDiff: keep the keys least similar to the head's mean key direction.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364); kvpress ``KeyDiffPress`` and, for the paper's
block-wise processing, ``BlockPress`` (https://github.com/NVIDIA/kvpress, ``kvpress/presses/``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polykv.contract import PHASES, ScoredRule, Selection, SelectionContext, param, ragged_top_k, top_k_sorted


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``-cos(k_j, anchor)`` with ``anchor = mean_j k_j / ||k_j||`` per head: keys [B, Hkv, T, d] -> [B, Hkv, T] float32.

    ``valid`` [B, Hkv, T] (bool) leaves padding columns out of the anchor.
    """
    keys = keys.float()                                                  # (B, Hkv, T, d)
    unit = F.normalize(keys, p=2, dim=-1)                                # (B, Hkv, T, d)
    if valid is None:
        anchor = unit.mean(dim=2, keepdim=True)                          # (B, Hkv, 1, d)
    else:
        weight = valid.to(unit.dtype).unsqueeze(-1)                      # (B, Hkv, T, 1)
        count = weight.sum(dim=2, keepdim=True).clamp_min(1.0)           # (B, Hkv, 1, 1)
        anchor = (unit * weight).sum(dim=2, keepdim=True) / count        # (B, Hkv, 1, d)
    return -F.cosine_similarity(keys, anchor, dim=-1)                    # (B, Hkv, T)


def blockwise_keep(keys: torch.Tensor, keep: int, block_size: int) -> torch.Tensor:
    """kvpress ``BlockPress`` order of work: start from the first ``keep`` tokens, then for each next block of
    ``block_size`` tokens rescore (kept + block) on their own and keep the top ``keep``.

    keys [B, Hkv, n, d] -> [B, Hkv, keep] int64 indices into n (unordered).
    """
    B, Hkv, n, d = keys.shape
    kept = torch.arange(keep, device=keys.device).expand(B, Hkv, keep)   # (B, Hkv, keep)
    for start in range(keep, n, block_size):
        block = torch.arange(start, min(start + block_size, n), device=keys.device).expand(B, Hkv, -1)
        current = torch.cat([kept, block], dim=-1)                       # (B, Hkv, keep + b)
        scores = keydiff_scores(keys.gather(2, current.unsqueeze(-1).expand(-1, -1, -1, d)))
        kept = current.gather(-1, scores.topk(keep, dim=-1).indices)     # (B, Hkv, keep)
    return kept


class KeyDiffRule(ScoredRule):
    """Keep, per KV head, the ``capacity`` stored keys whose direction differs most from the anchor.

    For one batch row and KV head with stored (post-RoPE) keys ``k_j`` [T, d]::

        anchor = mean_j k_j / ||k_j||            # [d], mean of the unit keys
        score[j] = -cos(k_j, anchor)             # higher = more distinctive = keep

    as kvpress ``KeyDiffPress`` (``F.normalize`` with eps 1e-12, then ``F.cosine_similarity`` with eps
    1e-8), computed in float32. The anchor is taken over the tokens the head stores now, so in decode it
    follows the kept set plus the new tokens, as kvpress's ``DecodingPress`` rescoring the whole cache
    does; padding columns of a ragged layer take no part in it. No sinks and no recent window (kvpress
    has none). Needs no attention and no queries: O(T d) per selection.

    With ``block_size = n > 0`` the selection follows kvpress ``BlockPress(KeyDiffPress(), block_size=n)``
    (its ``block_keydiff`` entry, n = 128), which simulates the paper's block-wise prompt processing: the
    first ``capacity`` stored tokens of a head, then each next block of n tokens in storage order, are
    rescored together (anchor over kept + block) and cut back to ``capacity``. As in kvpress the attention
    has seen the whole prompt; only the choice is block-wise.

    Shapes: keys [B, Hkv, T, d] -> scores [B, Hkv, T]; ``select`` -> [B, Hkv, capacity] (ragged Selection on
    ragged storage or per-head budgets).

    Parameters
    ----------
    block_size : int, default 0
        0: score every stored token at once (kvpress ``KeyDiffPress``); n > 0: block-wise (``BlockPress``).
    """

    name = "keydiff"
    phases = frozenset(PHASES)
    signal = "none"
    block_size: int = param(0, low=0, high=1 << 20,
                            description="0: score all stored tokens at once; n > 0: kvpress BlockPress blocks")
    shared_across_heads = False
    paper = ("Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
             "in Resource-Constrained Environments (arXiv:2504.15364)")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Negative cosine similarity to the per-head anchor: [B, Hkv, T] float32."""
        return keydiff_scores(ctx.keys, ctx.valid)

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor | Selection:
        """Top ``capacity`` scores per head, or with ``block_size`` the block-wise choice."""
        block = int(self.block_size)
        if block == 0:
            return super().select(ctx, capacity)
        B, Hkv, T = ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored
        if ctx.valid is None and ctx.head_capacity is None:
            chosen = torch.zeros(B, Hkv, T, device=ctx.keys.device)
            chosen.scatter_(-1, blockwise_keep(ctx.keys, capacity, block), 1.0)
            return top_k_sorted(chosen, capacity)
        budget = ctx.head_capacity if ctx.head_capacity is not None else torch.full((B, Hkv), capacity)
        counts = torch.minimum(budget.to(ctx.keys.device).long().expand(B, Hkv), ctx.head_lengths())
        chosen = torch.full((B, Hkv, T), -torch.inf, device=ctx.keys.device)  # (B, Hkv, T): 1 kept, 0 evicted
        for b in range(B):
            for h in range(Hkv):
                cols = torch.arange(T, device=ctx.keys.device)
                if ctx.valid is not None:
                    cols = cols[ctx.valid[b, h]]                         # this head's real columns, in order
                chosen[b, h, cols] = 0.0
                keys = ctx.keys[b, h, cols].view(1, 1, cols.numel(), -1)  # (1, 1, n, d)
                kept = blockwise_keep(keys, int(counts[b, h]), block).view(-1)
                chosen[b, h, cols[kept]] = 1.0
        return ragged_top_k(chosen, counts)
