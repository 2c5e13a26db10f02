"""D2O: layer budgets from attention variance, H2O eviction with sinks, and merging into the nearest kept key.

Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large
Language Models", ICLR 2025 (arXiv:2406.13035). Reference code: https://github.com/AIoT-MLSys-Lab/d2o
(``LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py``, ``D2O_LayerKVCache``).

Shapes: B batch, H query heads, Hkv KV heads, T stored tokens, C kept tokens, d head dim.

* Layer level (prefill, once): c[h, j] = column sums of the prompt's attention per query head;
  v_h = unbiased variance of c[h, :] over the tokens (mean over the batch);
  s = mean_h (v_h - min v) / (max v - min v + 1e-6) (:func:`layer_score`). Layers share a total:
  r_l = clamp(L rho softmax_l(-s), 0.01, 1) with rho the group's keep ratio (:func:`layer_budgets`).
* Token level: H2O accumulated attention; the first ``n_sink`` = 4 tokens and the ``recent`` newest are
  always kept, the rest of the budget goes to the heaviest hitters.
* Merge: each evicted token e finds the kept token j* whose key is most cosine-similar (per KV head),
  s_e = that similarity. An EMA threshold tau (one per layer and batch row, from that row's evicted
  tokens only: rows never change each other) gates the merge: e merges iff s_e >= tau.
  ``variant = "code"`` (default, the reference code): tau_0 = mean(s), tau = alpha tau + beta mean(s)
  with alpha = beta = 0.5, and x_j <- (x_j + sum_{e -> j} s_e x_e) / (1 + n_j) for keys and values.
  ``variant = "paper"`` (Eq. 8-11 as reported by a third-party port; not checked against the paper):
  tau_0 = max(s), tau = beta max(s) + (1 - beta) tau with beta = 0.7, and
  x_j <- (c x_j + sum_{e -> j} exp(s_e) x_e) / (c + sum_{e -> j} exp(s_e)) with c = 0.1.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from polykv.contract import (PHASES, Allocator, RuleState, ScoredRule, Selection, SelectionContext, allocators, param,
                             selection, state)

VARIANCE_EPS = 1e-6


def layer_score(column_sums: torch.Tensor) -> float:
    """D2O's layer statistic s from per-query-head column sums ``column_sums`` [B, H, T]."""
    v = column_sums.double().var(dim=-1).mean(dim=0)                        # (H,)
    return float(((v - v.min()) / (v.max() - v.min() + VARIANCE_EPS)).mean())


def layer_budgets(scores: Sequence[float], context_tokens: int, total_tokens: int) -> list[int]:
    """Tokens each layer keeps: ``floor(T * clamp(L rho softmax(-s), 0.01, 1))``, rho = total / (L T).

    The reference budgets ``int((T + 1) * r_l)``; polykv uses T, and when the clamps push the sum above
    ``total_tokens`` it removes the excess one token at a time from the largest layers (lowest index
    first), so a group never exceeds its budget.
    """
    L, T = len(scores), context_tokens
    rho = total_tokens / (L * T)
    s = torch.tensor(list(scores), dtype=torch.float64)
    r = (L * rho * torch.softmax(-s, dim=0)).clamp(0.01, 1.0)
    caps = [max(1, min(T, math.floor(T * float(x) + 1e-9))) for x in r]
    excess = sum(caps) - total_tokens
    while excess > 0:
        i = max(range(L), key=lambda j: (caps[j], -j))
        caps[i] -= 1
        excess -= 1
    return caps


def nearest_kept(keys: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every stored token: the kept slot with the most cosine-similar key, and that similarity.

    Returns (slot [B, Hkv, T] int64, similarity [B, Hkv, T] float32, evicted [B, Hkv, T] bool).
    Ties go to the lower slot.
    """
    B, Hkv, T, d = keys.shape
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    kept_k = k.gather(2, kept.unsqueeze(-1).expand(*kept.shape, d))          # (B, Hkv, C, d)
    sim = torch.matmul(k, kept_k.transpose(-1, -2))                          # (B, Hkv, T, C)
    best, slot = sim.max(dim=-1)
    evicted = torch.ones(B, Hkv, T, dtype=torch.bool, device=keys.device).scatter_(-1, kept, False)
    return slot, best, evicted


def update_threshold(tau: float | None, similarities: torch.Tensor, *, variant: str = "code",
                     alpha: float = 0.5, beta: float = 0.5) -> float:
    """The layer's threshold after one eviction with evicted-token similarities ``similarities`` (1-D)."""
    if similarities.numel() == 0:
        return tau if tau is not None else math.inf
    if variant == "code":
        stat = float(similarities.double().mean())
        return stat if tau is None else alpha * tau + beta * stat
    if variant == "paper":
        stat = float(similarities.double().max())
        return stat if tau is None else beta * stat + (1.0 - beta) * tau
    raise ValueError(f"rule 'd2o': variant must be 'code' or 'paper', got {variant!r}")


def row_thresholds(tau: Sequence[float] | None, sim: torch.Tensor, evicted: torch.Tensor, *, variant: str = "code",
                   alpha: float = 0.5, beta: float = 0.5) -> list[float]:
    """Each batch row's threshold after one eviction (:func:`update_threshold` on that row's evicted
    similarities ``sim[b][evicted[b]]``); ``tau`` holds the rows' thresholds so far, or None."""
    return [update_threshold(None if tau is None else tau[b], sim[b][evicted[b]], variant=variant, alpha=alpha,
                             beta=beta) for b in range(sim.shape[0])]


def merge_matrix(kept: torch.Tensor, slot: torch.Tensor, sim: torch.Tensor, evicted: torch.Tensor,
                 tau: float | Sequence[float], *, variant: str = "code", c: float = 0.1) -> torch.Tensor:
    """The merge as a matrix ``M`` [B, Hkv, C, T]: new kept rows ``x_kept_new = M @ x`` (keys and values).

    ``tau``: one threshold for every row, or one per batch row ([B])."""
    B, Hkv, C = kept.shape
    T = slot.shape[-1]
    if not isinstance(tau, (int, float)):
        tau = torch.tensor([float(t) for t in tau], dtype=sim.dtype, device=sim.device).view(B, 1, 1)
    gate = evicted & (sim >= tau)                                            # (B, Hkv, T)
    if variant == "code":
        w_e, w_self = sim.double(), torch.ones(B, Hkv, C, dtype=torch.float64, device=sim.device)
    else:
        w_e, w_self = torch.exp(sim.double()), torch.full((B, Hkv, C), c, dtype=torch.float64, device=sim.device)
    w_e = torch.where(gate, w_e, torch.zeros_like(w_e))
    M = torch.zeros(B, Hkv, C, T, dtype=torch.float64, device=sim.device)
    M.scatter_(-1, kept.unsqueeze(-1), w_self.unsqueeze(-1))                 # x_j itself
    onehot = torch.nn.functional.one_hot(slot, C).permute(0, 1, 3, 2).double()  # (B, Hkv, C, T)
    M = M + onehot * w_e.unsqueeze(2)
    if variant == "code":
        n = (onehot * gate.unsqueeze(2)).sum(-1)                             # merged count per slot
        denom = 1.0 + n
    else:
        denom = w_self + (onehot * w_e.unsqueeze(2)).sum(-1)
    return M / denom.unsqueeze(-1)


def as_merge(kept: torch.Tensor, slot: torch.Tensor, evicted: torch.Tensor, M: torch.Tensor) -> selection.Merge:
    """The matrix form of :func:`merge_matrix` as a :class:`~polykv.contract.selection.Merge` of keys and values.

    Each evicted column has one target, its nearest kept column; ``target_scale`` rescales the kept
    columns (1 / (1 + n_j) in the code variant).
    """
    B, Hkv, C, T = M.shape
    E = T - C
    ev = torch.sort(torch.where(evicted, torch.arange(T, device=kept.device), T), dim=-1).values[..., :E]  # (B,Hkv,E)
    target_slot = slot.gather(-1, ev)                                                               # (B, Hkv, E)
    cols = M.gather(3, ev.unsqueeze(2).expand(B, Hkv, C, E))                                       # (B, Hkv, C, E)
    weight = cols.gather(2, target_slot.unsqueeze(2)).squeeze(2)                                   # M[b, h, slot_e, e]
    self_w = M.gather(-1, kept.unsqueeze(-1)).squeeze(-1)                                          # (B, Hkv, C)
    scale = torch.ones(B, Hkv, T, dtype=torch.float32, device=kept.device).scatter_(-1, kept, self_w.float())
    return selection.Merge(evicted=ev, targets=kept.gather(-1, target_slot).unsqueeze(-1),
                           weights=weight.float().unsqueeze(-1), target_scale=scale, streams={"key", "value"})


class MergeThreshold(RuleState):
    """D2O's EMA merge threshold of one layer: ``tau``, one float per batch row (None until the first eviction)."""

    share_key = "d2o_merge_threshold"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.tau: list[float] | None = None

    def nbytes(self) -> int:
        return 8 * len(self.tau) if self.tau is not None else 0

    def predict_bytes(self, *, batch: int = 1, **shape) -> int:
        return 8 * batch


class D2ORule(ScoredRule):
    """D2O's eviction (H2O with sinks) and merge of every evicted token into its nearest kept key.

    Parameters
    ----------
    recent_ratio : float, default 0.5
        Share of the capacity kept as the newest tokens (reference: hh_ratio = recent_ratio).
    n_sink : int, default 4
        First stored tokens always kept (reference: positions 0..3).
    variant : {"code", "paper"}, default "code"
        Threshold and merge weights of the reference code, or of the paper's Eq. 8-11.
    alpha, beta : float, default 0.5
        Code variant: tau = alpha tau + beta mean(s).
    paper_beta : float, default 0.7
        Paper variant: tau = paper_beta max(s) + (1 - paper_beta) tau.
    paper_c : float, default 0.1
        Paper variant: weight of the kept token itself.
    """

    name = "d2o"
    phases = frozenset(PHASES)
    signal = "accumulated_attention"
    recent_ratio: float = param(0.5, low=0.0, high=1.0, description="share kept for recent tokens")
    n_sink: int = param(4, low=0, high=1 << 20, description="attention-sink tokens kept")
    variant: str = param("code", choices=("code", "paper"), description="threshold update")
    alpha: float = param(0.5, low=-1e6, high=1e6, description="code variant: weight of the old tau")
    beta: float = param(0.5, low=-1e6, high=1e6, description="code variant: weight of the mean")
    paper_beta: float = param(0.7, low=0.0, high=1.0, description="paper variant: weight of the max")
    paper_c: float = param(0.1, low=1e-12, high=1e6, description="paper variant: kept token weight")
    shared_across_heads = False
    paper = ("Wan et al., D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large "
             "Language Models, ICLR 2025 (arXiv:2406.13035)")

    def new_state(self) -> state.CompositeState:
        """H2O's accumulated attention (shared with any other rule of the layer) and the threshold."""
        return state.CompositeState(state.AccumulatedAttention(), MergeThreshold())

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        if ctx.accumulated is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'd2o' needs accumulated attention "
                             f"(ctx.accumulated) from its MergeThreshold state")
        return ctx.accumulated.float()

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        recent = math.floor(float(self.recent_ratio) * capacity + 1e-9)
        return int(self.n_sink), recent

    def select(self, ctx: SelectionContext, capacity: int) -> Selection:
        if ctx.valid is not None or ctx.head_capacity is not None:
            why = "this layer is ragged" if ctx.valid is not None else "a per-head allocator gave it per-head budgets"
            raise ValueError(f"layer {ctx.layer_idx}: rule 'd2o' merges evicted tokens into one kept set per row "
                             f"and needs every head to keep the same number of tokens ({why}); use a per-layer "
                             f"allocator or another rule on this layer")
        state = ctx.state.component(MergeThreshold) if ctx.state is not None else None
        if state is None:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'd2o' keeps its merge threshold in ctx.state "
                             f"(a MergeThreshold from new_state())")
        kept = selection.as_selection(super().select(ctx, capacity)).index
        slot, sim, evicted = nearest_kept(ctx.keys, kept)
        code = self.variant == "code"
        state.tau = row_thresholds(state.tau, sim, evicted, variant=self.variant, alpha=float(self.alpha),
                                   beta=float(self.beta if code else self.paper_beta))
        M = merge_matrix(kept, slot, sim, evicted, state.tau, variant=self.variant, c=float(self.paper_c))
        return Selection(index=kept, merge=as_merge(kept, slot, evicted, M))


class ColumnSumsPerHead(RuleState):
    """Column sums of a layer's prefill attention per query head: ``sums`` [B, H, T] float32 (D2O's allocator)."""

    share_key = "column_sums_per_head"
    needs = frozenset({state.COLUMN_SUMS_PER_HEAD})

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None

    def __init__(self):
        self.reset()

    def observe(self, obs: state.Observation) -> None:
        if obs.phase != "prefill":
            return
        sums = obs.column_sums_per_head()                                   # (B, H, K), read-only
        if self.sums is not None:
            sums = sums.clone()
            sums[..., : self.sums.shape[-1]] += self.sums
        self.sums = sums

    def after_prefill(self) -> None:
        self.sums = None

    def nbytes(self) -> int:
        return 0 if self.sums is None else self.sums.numel() * 4

    def predict_bytes(self, **shape) -> int:
        return 0  # dropped after prefill


class D2OAllocator(Allocator):
    """D2O's layer budgets (module docstring): more tokens for layers whose column sums vary less."""

    name = "d2o"
    defaults = {}
    paper = D2ORule.paper
    one_row = True
    """Budgets from the prompt's statistics, one per layer for every row: batches of one row only."""

    def new_state(self) -> ColumnSumsPerHead:
        return ColumnSumsPerHead()

    def layer_statistic(self, ctx) -> float:
        if not isinstance(ctx.state, ColumnSumsPerHead) or ctx.state.sums is None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'd2o' needs the layer's prefill column sums "
                             f"(its ColumnSumsPerHead state)")
        sums = ctx.state.sums
        if ctx.valid is not None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'd2o' cannot read a ragged layer")
        return layer_score(sums)

    def allocate(self, request: allocators.AllocationRequest) -> torch.Tensor:
        budgets = layer_budgets(list(request.statistics), request.context_tokens, request.total)
        return torch.tensor(budgets, dtype=torch.int64)
