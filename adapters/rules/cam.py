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
