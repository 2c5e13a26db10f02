"""Value-norm: keep the tokens whose value vectors have the largest L2 norm, plus attention sinks.

The value-norm term of VATP: Guo, Kamigaito, Watanabe, "Attention Score is not All You Need for
Token Importance Indicator in KV Cache Reduction: Value Also Matters", EMNLP 2024 (arXiv:2406.12335).
VATP multiplies accumulated attention by the value's L1 norm; this rule keeps only the norm (L2), so
it needs no attention. Sinks follow Xiao et al., StreamingLLM, ICLR 2024 (arXiv:2309.17453).
"""

from __future__ import annotations

import torch

from polykv.contract import ScoredRule, hookimpl, param


class ValueNormRule(ScoredRule):
    """Keep, per KV head, the first ``sinks`` tokens and then the largest value norms.

    ``score[j] = ||v_j||_2`` over the head dimension of the stored value v_j: [B, Hkv, T, d] ->
    [B, Hkv, T]. ``needs_values`` makes the runtime fill ``ctx.values`` (dequantized in decode). It runs in
    both phases and reads no attention (the defaults of ``phases`` and ``signal``).
    """

    name = "value-norm"
    needs_values = True
    sinks: int = param(4, low=0, high=1 << 20, description="attention sinks kept")
    paper = "Guo et al., Value Also Matters (VATP), EMNLP 2024 (arXiv:2406.12335)"

    def score(self, ctx) -> torch.Tensor:
        """Value L2 norms: [B, Hkv, T] float32."""
        if ctx.values is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'value-norm' needs ctx.values; "
                             f"the caller must fill them for a rule with needs_values=True")
        return ctx.values.float().norm(dim=-1)

    def protected(self, ctx, capacity: int) -> tuple[int, int]:
        """The first ``sinks`` stored tokens are always kept; no recent window."""
        return int(self.sinks), 0


@hookimpl
def register_rules(register):
    register(ValueNormRule)
