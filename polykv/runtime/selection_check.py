"""Checks on what a rule returned, so that a broken rule fails with one line naming layer, phase and rule."""

from __future__ import annotations

import attrs
import torch

from polykv.errors import RuntimeConfigError
from polykv.selection import Selection, as_selection


def checked_selection(result, ctx, capacity: int, *, where: str) -> Selection:
    """``result`` of ``rule.select(ctx, capacity)`` as a checked :class:`Selection`.

    Rectangular selections on uniform storage must be [B, Hkv, capacity]; every kept entry is a real
    (non-padding) column, strictly ascending per head; ragged counts never exceed a head's tokens
    and sum, per batch row, to at most ``capacity * Hkv`` (the sum of the per-head budgets when an
    allocator gave them). Ragged selections are trimmed to the longest head. A merge's targets must
    be kept tokens.
    """
    sel = as_selection(result)
    idx = sel.index
    B, Hkv, T = ctx.positions.shape
    fix = "(fix the rule's select())"
    if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, Hkv):
        raise RuntimeConfigError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                 f"expected ({B}, {Hkv}, k) int64 {fix}")
    if not sel.ragged and ctx.valid is None and ctx.head_capacity is None and idx.shape[2] != capacity:
        raise RuntimeConfigError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                 f"expected ({B}, {Hkv}, {capacity}) int64 {fix}")
    counts = sel.head_counts().to(idx.device)
    lengths = ctx.head_lengths().to(idx.device)
    if sel.ragged:
        if tuple(counts.shape) != (B, Hkv) or bool((counts < 0).any()) or bool((counts > lengths).any()):
            raise RuntimeConfigError(f"{where} returned per-head counts {counts.tolist()} for heads storing "
                                     f"{lengths.tolist()} tokens {fix}")
        budget = capacity * Hkv if ctx.head_capacity is None else ctx.head_capacity.sum(-1)
        if bool((counts.sum(-1) > torch.as_tensor(budget, device=idx.device)).any()):
            raise RuntimeConfigError(f"{where} kept {counts.sum(-1).tolist()} tokens per batch row, more than the "
                                     f"layer's budget {torch.as_tensor(budget).tolist()} {fix}")
        K = int(counts.max()) if counts.numel() else 0
        if idx.shape[2] != K:
            idx = idx[..., idx.shape[2] - K:]
            sel = attrs.evolve(sel, index=idx)
    kept = sel.kept_mask()
    if idx.numel():
        inside = (idx >= 0) & (idx < T)
        if not bool(inside[kept].all()):
            raise RuntimeConfigError(f"{where} returned indices outside [0, {T}) {fix}")
        steps = (idx[..., 1:] > idx[..., :-1]) | ~kept[..., :-1]
        if not bool(steps.all()):
            raise RuntimeConfigError(f"{where} returned indices that are not strictly ascending within "
                                     f"[0, {T}) {fix}")
        if ctx.valid is not None:
            real = ctx.valid.gather(-1, idx.clamp(0, T - 1))
            if not bool(real[kept].all()):
                raise RuntimeConfigError(f"{where} kept a padding column (ctx.valid is False there) {fix}")
    merge = sel.merge
    if merge is not None:
        E = merge.evicted.shape[-1]
        if (merge.evicted.dim() != 3 or tuple(merge.targets.shape[:3]) != (B, Hkv, E)
                or merge.weights.shape != merge.targets.shape or not merge.streams <= {"key", "value"}):
            raise RuntimeConfigError(f"{where} returned a merge of inconsistent shapes: evicted "
                                     f"{tuple(merge.evicted.shape)}, targets {tuple(merge.targets.shape)}, weights "
                                     f"{tuple(merge.weights.shape)}, streams {sorted(merge.streams)} {fix}")
        is_kept = torch.zeros(B, Hkv, T, dtype=torch.bool, device=idx.device)
        is_kept.scatter_(-1, idx.clamp(0, T - 1), kept)
        used = merge.weights != 0
        hits = is_kept.gather(-1, merge.targets.reshape(B, Hkv, -1).clamp(0, T - 1)).view_as(used)
        if not bool(hits[used].all()):
            raise RuntimeConfigError(f"{where} merges into tokens it does not keep {fix}")
    return sel
