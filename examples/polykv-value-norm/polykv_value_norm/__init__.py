"""Value-norm: keep the tokens whose value vectors have the largest L2 norm, plus attention sinks.

The value-norm term of VATP: Guo, Kamigaito, Watanabe, "Attention Score is not All You Need for
Token Importance Indicator in KV Cache Reduction: Value Also Matters", EMNLP 2024 (arXiv:2406.12335).
VATP multiplies accumulated attention by the value's L1 norm; this rule keeps only the norm (L2), so
it needs no attention. Sinks follow Xiao et al., StreamingLLM, ICLR 2024 (arXiv:2309.17453).
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, SIGNAL_NONE, ParamSpec, ScoredRule, SelectionContext, hookimpl


class ValueNormRule(ScoredRule):
    """Keep, per KV head, the first ``sinks`` tokens and then the largest value norms.

    ``score[j] = ||v_j||_2`` over the head dimension of the stored value v_j: [B, Hkv, T, d] ->
    [B, Hkv, T]. ``needs_values`` makes the runtime fill ``ctx.values`` (dequantized in decode).
    """

    name = "value-norm"
    phases = frozenset(PHASES)
    signal = SIGNAL_NONE
    needs_values = True
    param_specs = {"sinks": ParamSpec(int, default=4, low=0, high=1 << 20, description="attention sinks kept")}
    paper = "Guo et al., Value Also Matters (VATP), EMNLP 2024 (arXiv:2406.12335)"

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Value L2 norms: [B, Hkv, T] float32."""
        if ctx.values is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'value-norm' needs ctx.values; "
                             f"the caller must fill them for a rule with needs_values=True")
        return ctx.values.float().norm(dim=-1)

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        """The first ``sinks`` stored tokens are always kept; no recent window."""
        return int(self.params["sinks"]), 0


@hookimpl
def register_rules(register):
    register(ValueNormRule)
