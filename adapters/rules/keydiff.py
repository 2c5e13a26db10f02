"""KeyDiff: keep the keys least similar to the layer's mean key direction.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364); kvpress ``KeyDiffPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/keydiff_press.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polykv.contract import PHASES, SIGNAL_NONE, ScoredRule, SelectionContext


class KeyDiffRule(ScoredRule):
    """Keep, per KV head, the ``capacity`` stored keys whose direction differs most from the anchor.

    For one batch row and KV head with stored (post-RoPE) keys ``k_j`` [T, d]::

        anchor = mean_j k_j / ||k_j||            # [d], mean of the unit keys
        score[j] = -cos(k_j, anchor)             # higher = more distinctive = keep

    as kvpress ``KeyDiffPress`` (``F.normalize`` with eps 1e-12, then ``F.cosine_similarity`` with eps
    1e-8), computed in float32. The anchor is taken over the tokens the head stores now, so in decode it
    follows the kept set plus the new tokens, as kvpress's decoding wrapper rescoring the whole cache
    does; padding columns of a ragged layer take no part in it. Needs no attention and no queries:
    O(T d) per selection. No sinks, window or parameters (kvpress has none). The paper evicts block by
    block during prefill (kvpress simulates it with ``BlockPress``); in polykv that is chunked prefill
    with this rule in the prefill phase.

    Shapes: keys [B, Hkv, T, d] -> scores [B, Hkv, T].
    """

    name = "keydiff"
    phases = frozenset(PHASES)
    signal = SIGNAL_NONE
    param_specs = {}
    shared_across_heads = False
    paper = ("Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
             "in Resource-Constrained Environments (arXiv:2504.15364)")

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Negative cosine similarity to the per-head anchor: [B, Hkv, T] float32."""
        keys = ctx.keys.float()                                          # (B, Hkv, T, d)
        unit = F.normalize(keys, p=2, dim=-1)                            # (B, Hkv, T, d)
        if ctx.valid is None:
            anchor = unit.mean(dim=2, keepdim=True)                      # (B, Hkv, 1, d)
        else:
            weight = ctx.valid.to(unit.dtype).unsqueeze(-1)              # (B, Hkv, T, 1)
            count = weight.sum(dim=2, keepdim=True).clamp_min(1.0)       # (B, Hkv, 1, 1)
            anchor = (unit * weight).sum(dim=2, keepdim=True) / count    # (B, Hkv, 1, d)
        return -F.cosine_similarity(keys, anchor, dim=-1)                # (B, Hkv, T)
