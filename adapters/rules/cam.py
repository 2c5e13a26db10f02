"""CaM: merge each evicted value into the kept tokens that follow it, on top of any eviction rule.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024. Reference code:
https://github.com/zyxxmu/cam (``generate_task/streaming_llm/kv_cache_cam.py``, merge window 16 on
the streaming path, 32 on the generation path) and kvpress ``CAMPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/cam_press.py``, ``merge_budget = 32``).

Shapes: B batch, Hkv KV heads, T stored tokens, C kept tokens, d head dim.

The base rule names the kept tokens. For every evicted token e of a KV head, its merge window W_e
is the (at most) m kept tokens that follow e in storage order. With A the accumulated attention,

    p_e = clamp(A_e / mean_{j in W_e} A_j, 0, 1)      (0 when undefined)
    M_e ~ Bernoulli(p_e)                              (independently per KV head)
    V_j += M_e * V_e / |W_e|      for j in W_e        (kvpress; the official code divides by m)

Keys are not merged. Evicted tokens with no kept successor are dropped unmerged.
"""

from __future__ import annotations

import torch

from polykv.adapters.rules.wrapping import build_inner_rule
from polykv.contract import PHASES, RetentionRule, RuleState, Selection, SelectionContext, param, selection, state


def merge_weights(kept: torch.Tensor, accumulated: torch.Tensor, *, merge_window: int,
                  generator: torch.Generator | None, divide_by: str = "window") -> torch.Tensor:
    """The merge as a matrix: ``W`` [B, Hkv, C, T] with ``V_kept_new = V_kept + W @ V`` (rows: kept slots).

    Parameters
    ----------
    kept : [B, Hkv, C] int64
        Ascending kept indices of every KV head.
    accumulated : [B, Hkv, T]
        Accumulated attention of every stored token.
    merge_window : int
        m, the number of kept successors an evicted value is spread over.
    generator : torch.Generator or None
        Draws the Bernoulli merge mask (one uniform per stored token and head, in storage order).
    divide_by : {"window", "m"}
        ``"window"``: divide by the actual window size |W_e| (kvpress). ``"m"``: always divide by m
        (official streaming code).
    """
    B, Hkv, C = kept.shape
    T = accumulated.shape[-1]
    device = accumulated.device
    acc = accumulated.double()
    is_kept = torch.zeros(B, Hkv, T, dtype=torch.bool, device=device).scatter_(-1, kept, True)
    first_slot = is_kept.long().cumsum(-1) - is_kept.long()                  # kept tokens before j = slot of j's first successor
    kept_acc = acc.gather(-1, kept)                                          # (B, Hkv, C)
    prefix = torch.nn.functional.pad(kept_acc.cumsum(-1), (1, 0))            # (B, Hkv, C+1)
    stop = (first_slot + merge_window).clamp(max=C)
    size = stop - first_slot                                                 # |W_e|
    window_sum = prefix.gather(-1, stop) - prefix.gather(-1, first_slot)
    mean = window_sum / size.clamp(min=1)
    p = torch.nan_to_num(acc / mean, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    draws = torch.rand(B, Hkv, T, generator=generator, device=generator.device if generator is not None else device)
    mask = (draws.to(device).double() < p) & ~is_kept & (size > 0)
    denom = size.double() if divide_by == "window" else torch.full_like(acc, float(merge_window))
    if divide_by not in ("window", "m"):
        raise ValueError(f"rule 'cam': divide_by must be 'window' or 'm', got {divide_by!r}")
    weight = torch.where(mask, 1.0 / denom.clamp(min=1), torch.zeros_like(acc))   # (B, Hkv, T)
    slots = torch.arange(C, device=device).view(1, 1, C, 1)
    inside = (slots >= first_slot.unsqueeze(2)) & (slots < stop.unsqueeze(2))     # (B, Hkv, C, T)
    return torch.where(inside, weight.unsqueeze(2), torch.zeros((), dtype=torch.float64, device=device))


def merge_values(values: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Kept values after the merge: [B, Hkv, C, d] = V[kept] + W @ V (computed in float32)."""
    d = values.shape[-1]
    base = values.gather(2, kept.unsqueeze(-1).expand(*kept.shape, d)).float()
    return (base + torch.matmul(weights.float(), values.float())).to(values.dtype)


def as_merge(kept: torch.Tensor, weights: torch.Tensor) -> selection.Merge:
    """The matrix form of :func:`merge_weights` as a :class:`~polykv.contract.selection.Merge` of values.

    Every evicted column (E = T - C per head) lists the kept columns of its window as targets, with
    weight 0 where the window is shorter or the Bernoulli draw said no.
    """
    B, Hkv, C, T = weights.shape
    is_kept = torch.zeros(B, Hkv, T, dtype=torch.bool, device=kept.device).scatter_(-1, kept, True)
    evicted = torch.sort(torch.where(is_kept, T, torch.arange(T, device=kept.device)), dim=-1).values[..., : T - C]
    cols = weights.transpose(-1, -2).gather(2, evicted.unsqueeze(-1).expand(B, Hkv, T - C, C))   # (B, Hkv, E, C)
    width = max(1, int((cols != 0).sum(-1).max()) if cols.numel() else 1)
    w, slot = torch.topk(cols, width, dim=-1)                                  # non-zero weights first
    targets = kept.unsqueeze(2).expand(B, Hkv, T - C, C).gather(-1, slot)
    return selection.Merge(evicted=evicted, targets=targets, weights=w.float(), streams={"value"})


class CaMRule(RetentionRule):
    """CaM on top of an inner eviction rule (module docstring): the inner rule keeps, CaM merges values.

    Parameters
    ----------
    rule : str, default "streamingllm"
        The eviction rule that picks the kept tokens (the official code's base).
    rule_params : dict, default {}
        Its parameters.
    merge_window : int, default 32
        m, the kept successors an evicted value is spread over (kvpress and the official generation
        path; 16 on its streaming path).
    divide_by : {"window", "m"}, default "window"
        Divide by the actual window size (kvpress) or by m (official streaming code).
    """

    name = "cam"
    phases = frozenset(PHASES)
    signal = "accumulated_attention"
    rule: str = param("streamingllm", description="the rule choosing which tokens stay")
    rule_params: dict = param({}, description="parameters of that rule")
    merge_window: int = param(32, low=1, high=1 << 20, description="tokens an evicted one may merge into")
    divide_by: str = param("window", choices=("window", "m"), description="merge weight normaliser")
    shared_across_heads = False
    paper = "Zhang et al., CaM: Cache Merging for Memory-efficient LLMs Inference, ICML 2024"

    def __attrs_post_init__(self):
        self.inner = build_inner_rule(self.name, self.rule, self.rule_params)
        self.phases = self.inner.phases
        self.needs_values = True

    def new_state(self) -> RuleState:
        inner = self.inner.new_state()
        if inner is not None and inner.component(state.AccumulatedAttention) is not None:
            return inner
        if inner is None:
            return state.AccumulatedAttention()
        return state.CompositeState(inner, state.AccumulatedAttention())

    def select(self, ctx: SelectionContext, capacity: int) -> Selection:
        if ctx.phase not in self.inner.phases:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'cam' wraps '{self.rule}', which does not run "
                             f"in the {ctx.phase} phase")
        if ctx.valid is not None:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'cam' merges along storage order and needs every head to "
                             f"store the same number of tokens (this layer is ragged)")
        if ctx.accumulated is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'cam' needs accumulated attention "
                             f"(ctx.accumulated); its state must contain an AccumulatedAttention")
        if ctx.generator is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'cam' draws its merge mask from "
                             f"ctx.generator; the runtime must pass a seeded generator")
        inner = selection.as_selection(self.inner.select(ctx, capacity))
        if inner.ragged or inner.merge is not None:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'cam' needs a plain selection from its inner rule "
                             f"'{self.rule}' (no ragged heads, no merge of its own)")
        B, Hkv, T = ctx.positions.shape
        kept = inner.index.expand(B, Hkv, -1)
        W = merge_weights(kept, ctx.accumulated, merge_window=int(self.merge_window),
                          generator=ctx.generator, divide_by=self.divide_by)
        return Selection(index=kept, merge=as_merge(kept, W))
