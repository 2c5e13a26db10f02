"""TOVA: token omission via attention of the current query, one index set per layer.

Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are Multi-State RNNs", EMNLP 2024
(arXiv:2401.06104). Reference code: https://github.com/schwartz-lab-NLP/TOVA.
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, ScoredRule, SelectionContext


class TOVARule(ScoredRule):
    """Keep the ``capacity`` tokens the newest query attends to most, averaged over all query heads.

    ``score[j] = mean over the H query heads of softmax_j(q_last . k_j * scaling)``; one index set
    is shared by every KV head of the layer. No sinks and no recent window (as in the original).
    In prefill the newest query is the last prompt token; in decode it is the current token.
    """

    name = "tova"
    phases = frozenset(PHASES)
    signal = "last_query"
    defaults = {}
    shared_across_heads = True
    paper = "Oren et al., Transformers are Multi-State RNNs, EMNLP 2024 (arXiv:2401.06104)"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Head-averaged attention of the last query: [B, 1, T] float32."""
        if ctx.queries is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'tova' needs the last query (ctx.queries); "
                f"the runtime must keep signal '{self.signal}' for this layer"
            )
        attn = ctx.window_attention(1)                                   # (B, H, 1, T)
        return attn[:, :, -1, :].mean(dim=1, keepdim=True)               # (B, 1, T)
