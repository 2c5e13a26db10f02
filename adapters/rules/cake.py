"""CAKE: layer budgets from attention dispersion, and an eviction indicator with a variance term.

Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025
(arXiv:2503.12491). Reference code: https://github.com/antgroup/cakekv (``cake/model/modify_llama.py``
``llama_attn_forward_cake``, ``cake/cake_cache.py``, ``cake/utils.py``).

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, w observation window, T stored tokens.
A = softmax attention of the last w prompt queries over every stored key (causal inside the window).

* Preference of a layer (prefill): ``P = Hent ** (1 / tau1) * Var ** (1 / tau2)`` with
  ``Hent = -sum A[..., :T-w] log(A[..., :T-w] + 1e-10)`` (summed over batch, heads, window rows and
  non-window columns, no renormalisation) and ``Var = sum`` over batch, heads and non-window columns of
  the unbiased variance over the w rows (:func:`layer_preference`).
* Budgets: the non-window total ``N`` is split in proportion to P and adjusted (:func:`split_budgets`);
  a layer keeps its ``B_l`` best non-window tokens plus the window.
* Indicator (prefill): ``I[j] = mean_i A[i, j] + gamma * Var_i A[i, j]`` over the w rows, for the
  non-window tokens, smoothed by a zero-padded average pool (kernel 5) per query head, averaged over
  the G heads of each KV head (:func:`eviction_indicator`).
* Decode (every eviction): the same pool of the newest query's attention, no variance term, averaged
  over the G heads; the last w stored tokens are kept.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from polykv.contract import PHASES, Allocator, ScoredRule, SelectionContext, allocators, newest_tokens, param, state

ENTROPY_EPS = 1e-10
"""Inside the log of the entropy, as in the reference."""


def layer_preference(attn: torch.Tensor, window: int, tau1: float, tau2: float) -> float:
    """CAKE's preference score of one layer from its window attention ``attn`` [B, H, w, T]."""
    prefix = attn[..., : attn.shape[-1] - window].double()             # (B, H, w, T-w)
    entropy = -(prefix * torch.log(prefix + ENTROPY_EPS)).sum()
    variance = prefix.var(dim=2).sum() if prefix.shape[2] > 1 else prefix.new_zeros(())
    return float(entropy ** (1.0 / tau1) * variance ** (1.0 / tau2))


def eviction_indicator(attn: torch.Tensor, window: int, num_kv_heads: int, *, gamma: float,
                       kernel_size: int = 5) -> torch.Tensor:
    """CAKE's indicator of the non-window tokens: [B, Hkv, T - w] float32.

    ``attn`` [B, H, r, T] holds r >= 1 attention rows; with one row the variance term is absent
    (decode), otherwise it is the unbiased variance over the rows times ``gamma``.
    """
    B, H, r, T = attn.shape
    attn = attn.float()
    score = attn.mean(dim=2)
    if r > 1 and gamma:
        score = score + gamma * attn.var(dim=2)
    score = score[..., : T - window]                                     # (B, H, T-w)
    if T - window > 0:
        score = F.avg_pool1d(score, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    return score.view(B, num_kv_heads, H // num_kv_heads, -1).mean(dim=2)


def split_budgets(preferences: Sequence[float], total: int, limit: int) -> list[int]:
    """Non-window budgets ``B_l`` proportional to ``preferences``, each at most ``limit``, summing to ``total``.

    The reference's ``adjust_budgets``: truncate ``P_l / sum P * total`` to int; cap at ``limit``
    and spread the excess evenly over the uncapped layers (remainder to the lowest indices); then
    fix the sum to ``total`` the same way (adding only to layers below ``limit``, removing only
    from layers above 1). When ``total >= L * limit`` every layer gets ``limit``.
    """
    L = len(preferences)
    if total >= L * limit:
        return [limit] * L
    s = float(sum(preferences))
    budgets = [int(p / s * total) if s > 0 else total // L for p in preferences]
    excess = sum(max(b - limit, 0) for b in budgets)
    budgets = [min(b, limit) for b in budgets]
    budgets = _spread(budgets, excess, [b < limit for b in budgets])
    diff = total - sum(budgets)
    if diff > 0:
        budgets = _spread(budgets, diff, [b < limit for b in budgets])
    elif diff < 0:
        budgets = _spread(budgets, diff, [b > 1 for b in budgets])
    return budgets


def _spread(budgets: list[int], amount: int, valid: list[bool]) -> list[int]:
    """Add ``amount`` (negative: remove) evenly over the ``valid`` layers, remainder to the first ones."""
    idx = [i for i, v in enumerate(valid) if v]
    if not amount or not idx:
        return budgets
    sign, n = (1 if amount > 0 else -1), abs(amount)
    per, rem = divmod(n, len(idx))
    out = list(budgets)
    for k, i in enumerate(idx):
        out[i] += sign * (per + (1 if k < rem else 0))
    return out


class CAKERule(ScoredRule):
    """Keep the last ``window`` tokens plus the top non-window tokens by CAKE's indicator, per KV head.

    Prefill scores with :func:`eviction_indicator` over the last ``window`` prompt queries (mean +
    ``gamma`` x variance, pooled); decode scores with the newest query only (no variance term), as
    the reference does at every decode step. The capacity of a layer (window included) comes from
    the plan, or from the ``cake`` allocator that splits a group's budget by layer preference.
    When ``capacity <= window`` the last ``capacity`` tokens are kept.

    Parameters
    ----------
    window : int, default 32
        Observation window (reference ``--window_size 32``), always kept.
    gamma : float, default 200.0
        Weight of the attention variance in the indicator (reference ``gamma = 200``).
    kernel_size : int, default 5
        Average-pool kernel of the indicator (reference: 5, zero padding counted).
    """

    name = "cake"
    phases = frozenset(PHASES)
    signal = "observation_window"
    window: int = param(32, low=1, high=1 << 20, description="observation window in tokens")
    gamma: float = param(200.0, low=0.0, high=1e12, description="weight of the attention variance")
    kernel_size: int = param(5, low=1, high=1 << 12, odd=True, description="pooling kernel")
    shared_across_heads = False
    paper = ("Qin et al., CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences, ICLR 2025 "
             "(arXiv:2503.12491)")

    def _window(self, ctx: SelectionContext) -> int:
        return min(int(self.window), ctx.num_stored)

    def _attention(self, ctx: SelectionContext) -> torch.Tensor:
        if ctx.queries is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'cake' needs the last {self.window} "
                f"queries (ctx.queries); the runtime must keep signal '{self.signal}' for this layer")
        rows = 1 if ctx.phase == "decode" else min(self._window(ctx), ctx.queries.shape[2])
        return ctx.window_attention(rows)                                 # (B, H, rows, T)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Indicator of the non-window tokens, +inf on the window: [B, Hkv, T] float32."""
        w = self._window(ctx)
        ind = eviction_indicator(self._attention(ctx), w, ctx.num_kv_heads, gamma=float(self.gamma),
                                 kernel_size=int(self.kernel_size))
        return torch.cat([ind, ind.new_full((*ind.shape[:2], w), math.inf)], dim=-1)

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor:
        if capacity <= self._window(ctx):
            return newest_tokens(ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored, capacity, ctx.keys.device)
        return super().select(ctx, capacity)

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        return 0, self._window(ctx)


class CAKEAllocator(Allocator):
    """CAKE's layer budgets: the group's non-window total split in proportion to layer preference.

    Each layer's preference (:func:`layer_preference`) comes from the last ``window`` prompt queries,
    kept by this allocator's own query window; budgets are :func:`split_budgets` of the group total
    minus ``window`` per layer, capped at ``T - window``, plus the window, so the windows count inside
    the group's total (the paper's B_l includes the window; the reference code adds it on top). When
    the total cannot hold a window per layer, every layer keeps an equal share of it, all newest
    tokens. The group never holds more than its total. Allocated once, after the
    group's last layer: budgets only shrink as layers are added, so the reference's cascade ends in
    the same cache (it only lowers the prefill peak).

    Parameters
    ----------
    window : int, default 32
        Observation window (must equal the ``cake`` rule's).
    tau1, tau2 : float, default 1.0
        Preference exponents. The reference tunes them per model for budgets 128 and 1024
        (``config/model2tau.json``) and uses 1.0 for any other budget.
    """

    name = "cake"
    window: int = param(32, low=1, high=1 << 20, description="observation window in tokens")
    tau1: float = param(1.0, low=1e-6, high=1e6, description="preference exponent of the entropy")
    tau2: float = param(1.0, low=1e-6, high=1e6, description="preference exponent of the variance")
    paper = CAKERule.paper
    one_row = True
    """Budgets from the prompt's statistics, one per layer for every row: batches of one row only."""

    def check_op(self, op) -> tuple[str, str] | None:
        """A member ``cake`` rule must keep the window this allocator budgets (each layer's share holds it)."""
        if op.rule != CAKERule.name:
            return None
        rule_window = op.params.get("window", CAKERule.defaults["window"])
        if rule_window != self.window:
            return ("params.window", f"rule 'cake' keeps a window of {rule_window} tokens but allocator 'cake' "
                    f"budgets a window of {self.window}; the two must be equal")
        return None

    def new_state(self) -> state.QueryWindow:
        return state.QueryWindow(int(self.window))

    def layer_statistic(self, ctx: SelectionContext) -> float:
        held = ctx.state
        if not isinstance(held, state.QueryWindow) or held.queries is None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'cake' needs the last prompt queries (its QueryWindow)")
        w = min(int(self.window), ctx.num_stored, held.queries.shape[2])
        view = attrs.evolve(ctx, queries=held.queries, query_positions=held.positions)
        return layer_preference(view.window_attention(w), w, float(self.tau1), float(self.tau2))

    def allocate(self, request: allocators.AllocationRequest) -> torch.Tensor:
        n, w, S = len(request.layers), int(self.window), request.context_tokens
        w = min(w, S)
        total = request.total * n // len(request.group_layers)
        if total < w * n:
            # The windows alone exceed the group's total: each layer keeps an equal share, all of it window
            # (the rule keeps the newest ``capacity`` tokens when ``capacity <= window``).
            return torch.tensor(_spread([0] * n, total, [True] * n), dtype=torch.int64)
        budgets = split_budgets(list(request.statistics), total - w * n, max(S - w, 0))
        return torch.tensor([b + w for b in budgets], dtype=torch.int64)
