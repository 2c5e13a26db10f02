"""Ada-KV: head-wise budgets inside a layer, around any scored rule (SnapKV by default).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", arXiv:2407.11550. Reference code: https://github.com/FFY0/AdaKV
(``adaptive_snapkv/monkeypatch/snapkv_utils.py``, ``AdaptiveSnapKVCluster.update_kv``).

Shapes: B batch, Hkv KV heads, T stored tokens, n = T - protected candidate tokens per head.

The inner rule scores every token per KV head and protects its first / last tokens (SnapKV: the
observation window). With C the layer capacity and ``Bavg = C - protected`` the average number of
candidates a head keeps, Ada-KV ranks the candidates of all Hkv heads together, takes the global top
``Hkv * Bavg``, and counts ``c_h``, how many of them fall in head h. Head h then keeps its own top

    B_h = round((1 - alpha) * c_h + floor(alpha * Bavg))

candidates plus the protected tokens (:func:`head_budgets`), so kept counts differ per head and the
storage is ragged.
"""

from __future__ import annotations

import math

import torch

from polykv.adapters.rules.wrapping import build_inner_rule
from polykv.contract import ParamError, RetentionRule, ScoredRule, SelectionContext, param, ragged_top_k


def head_budgets(scores: torch.Tensor, average: int, *, floor_alpha: float = 0.2,
                 rounding: str = "exact") -> torch.Tensor:
    """Candidates each KV head keeps: [B, Hkv] int64.

    Parameters
    ----------
    scores : [B, Hkv, n]
        Candidate scores per KV head (higher = keep); protected tokens excluded.
    average : int
        Average candidates per head, ``0 <= average <= n``.
    floor_alpha : float
        Share of ``average`` every head gets regardless of scores (reference ``floor_alpha``).
    rounding : {"exact", "reference"}
        ``"reference"`` rounds each head half-to-even as the reference does, so the layer total can
        drift from ``Hkv * average`` by a few tokens. ``"exact"`` rounds by largest remainders
        (ties to the lower head index) so the total is exactly ``Hkv * average``.
    """
    B, Hkv, n = scores.shape
    if not 0 <= average <= n:
        raise ValueError(f"rule 'adakv': average head budget {average} must lie in [0, {n}]")
    if not 0.0 <= floor_alpha <= 1.0:
        raise ValueError(f"rule 'adakv': floor_alpha must lie in [0, 1], got {floor_alpha}")
    flat = scores.float().reshape(B, Hkv * n)
    # The tie-breaker of top_k_sorted: earlier (head, token) wins among equal scores.
    order = torch.arange(Hkv * n, device=scores.device, dtype=torch.float64)
    winners = torch.topk(flat.double() - order * 1e-12, Hkv * average, dim=-1).indices // n   # (B, Hkv*avg)
    won = torch.zeros(B, Hkv, dtype=torch.int64, device=scores.device)
    won.scatter_add_(-1, winners, torch.ones_like(winners))
    floor_cap = math.floor(average * floor_alpha + 1e-9)
    raw = won.double() * (1.0 - floor_alpha) + floor_cap                                     # (B, Hkv)
    if rounding == "reference":
        return torch.round(raw).to(torch.int64).clamp(0, n)
    if rounding != "exact":
        raise ValueError(f"rule 'adakv': rounding must be 'exact' or 'reference', got {rounding!r}")
    base = torch.floor(raw + 1e-9).to(torch.int64)
    short = Hkv * average - base.sum(dim=-1)                                                  # (B,)
    frac = raw - base.double()
    rank = torch.argsort(torch.argsort(-(frac - torch.arange(Hkv, device=raw.device) * 1e-9), dim=-1), dim=-1)
    return (base + (rank < short.unsqueeze(-1)).to(torch.int64)).clamp(0, n)


class AdaKVRule(RetentionRule):
    """Ada-KV's head-wise budgets around an inner scored rule (module docstring); ragged storage.

    Parameters
    ----------
    rule : str, default "snapkv"
        The scored rule whose scores and protected tokens Ada-KV uses.
    rule_params : dict, default {}
        Its parameters (SnapKV's defaults, window 32 / kernel 7 / max pooling, are Ada-KV's).
    floor_alpha : float, default 0.2
        Share of the average budget every head keeps regardless of scores (reference README for GQA;
        the reference's ``config_compress`` default is 0.5).
    rounding : {"exact", "reference"}, default "exact"
        How per-head budgets are rounded (:func:`head_budgets`); with ``"reference"`` a layer whose
        total would exceed its budget is trimmed at its largest heads.
    """

    name = "adakv"
    phases = frozenset({"prefill"})
    signal = "observation_window"
    rule: str = param("snapkv", description="the scoring rule whose scores Ada-KV allocates by")
    rule_params: dict = param({}, description="parameters of that rule")
    floor_alpha: float = param(0.2, low=0.0, high=1.0, description="share of the budget kept as a per-head floor")
    rounding: str = param("exact", choices=("exact", "reference"), description="budget rounding")
    shared_across_heads = False
    paper = ("Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM "
             "Inference, arXiv:2407.11550")

    def __attrs_post_init__(self):
        self.inner = build_inner_rule(self.name, self.rule, self.rule_params)
        self.phases = frozenset({"prefill"}) & self.inner.phases
        self.needs_values = self.inner.needs_values  # the runtime hands values to the rule it calls
        if not self.phases:
            raise ParamError("rule", f"rule 'adakv': inner rule '{self.rule}' does not run in prefill, where Ada-KV "
                                     f"allocates")
        if not isinstance(self.inner, ScoredRule):
            raise ParamError("rule", f"rule 'adakv': inner rule '{self.rule}' must be a scored rule (score + "
                                     f"protected), e.g. snapkv, h2o, tova")

    def new_state(self):
        return self.inner.new_state()

    def select(self, ctx: SelectionContext, capacity: int):
        if ctx.valid is not None:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'adakv' allocates over a layer whose heads store the same "
                             f"tokens (prefill); this layer is already ragged")
        B, Hkv, T = ctx.positions.shape
        n_first, n_last = self.inner.protected(ctx, capacity)
        n_first, n_last = min(n_first, capacity), min(n_last, max(capacity - n_first, 0))
        average = capacity - n_first - n_last
        if average <= 0 or T - n_first - n_last <= average:
            return self.inner.select(ctx, capacity)
        scores = self.inner.score(ctx).float().expand(B, Hkv, T)
        counts = head_budgets(scores[..., n_first: T - n_last], average, floor_alpha=float(self.floor_alpha),
                              rounding=self.rounding)
        counts = _trim_heads(counts, Hkv * average)
        keyed = scores.clone()
        keyed[..., :n_first] = math.inf
        keyed[..., T - n_last:] = math.inf
        return ragged_top_k(keyed, counts + n_first + n_last)


def _trim_heads(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Remove tokens from the largest heads (lowest index first) until each row sums to at most ``total``."""
    counts = counts.clone()
    for b in range(counts.shape[0]):
        while int(counts[b].sum()) > total:
            counts[b, int(torch.argmax(counts[b]))] -= 1
    return counts
