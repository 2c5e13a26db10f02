"""The error of sharing a layer pair (MiniCache, ``LayerPlan.share``): per adjacent pair (l - 1, l), the relative
L2 error of both layers' attention outputs when the pair's prefix is merged, for a solver to weigh.

The convention is :mod:`polykv.profiling.sensitivity`'s: a captured sequence of T tokens is split into a prefix
of P tokens (the prompt, merged after prefill) and F = T - P follow-up tokens (decode, stored unmerged). Both
layers' prefixes fill the runtime's stores of a 16-bit layer each (:func:`polykv.runtime.layers.new_storage`), the runtime's own
:meth:`~polykv.runtime.storage.LayerStorage.share_prompt` merges them, the follow-up K/V are appended, and the
F follow-up queries of each layer attend its stored view (:func:`polykv.attention.kernels.sdpa`). Error per
layer: ``||o_shared - o_full||_F / ||o_full||_F`` of the follow-up attention output [B, H, F, d] before
``o_proj``, mean over sequences (batch rows). Each pair is measured alone (pairs overlapping a layer are
alternatives, not a plan).

Shapes: B sequences, H query heads, Hkv KV heads, P prefix, F follow-up, d head dim.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from polykv.attention.kernels import sdpa
from polykv.plan import LayerPlan
from polykv.profiling.capture import LayerCapture
from polykv.profiling.sensitivity import full_reference, relative_error
from polykv.runtime.layers import new_storage
from polykv.storage.layer_share import DEFAULT_INTERPOLATION, DEFAULT_RETENTION_RATIO


@attrs.define(frozen=True, kw_only=True)
class PairError:
    """The measured error of one shared pair."""

    lower: int
    upper: int
    lower_error: float
    """Relative L2 error of layer ``lower``'s follow-up attention output."""
    upper_error: float
    """Relative L2 error of layer ``upper``'s follow-up attention output."""

    @property
    def total(self) -> float:
        """The pair's loss in an additive model: the sum of both layers' errors."""
        return self.lower_error + self.upper_error


def _stored(cap: LayerCapture, prefix: int):
    B, Hkv = cap.key.shape[:2]
    dtype, device = cap.key.dtype, cap.key.device
    storage = new_storage(LayerPlan(layer=cap.layer_idx), None, dtype=dtype, device=device)  # 16 bits
    pos = torch.arange(prefix, device=device).view(1, 1, prefix).expand(B, Hkv, prefix)
    storage.fill(cap.key[:, :, :prefix], cap.value[:, :, :prefix], pos)
    return storage


@torch.no_grad()
def pair_error(lower: LayerCapture, upper: LayerCapture, prefix: int, *,
               interpolation: float = DEFAULT_INTERPOLATION,
               retention_ratio: float = DEFAULT_RETENTION_RATIO) -> PairError:
    """The error of merging the P-token prefix of ``lower`` (layer l - 1) and ``upper`` (layer l); see the module."""
    if upper.layer_idx != lower.layer_idx + 1:
        raise ValueError(f"a shared pair is two adjacent layers, got layers {lower.layer_idx} and {upper.layer_idx}")
    T = upper.num_tokens
    if lower.num_tokens != T or not 0 < prefix < T:
        raise ValueError(f"layers {lower.layer_idx}-{upper.layer_idx}: prefix {prefix} must lie strictly inside one "
                         f"sequence of both layers ({lower.num_tokens} and {T} tokens)")
    stores = [_stored(lower, prefix), _stored(upper, prefix)]
    dtype = upper.key.dtype
    stores[1].share_prompt(stores[0], held_dtype=dtype, compute_dtype=dtype, interpolation=interpolation,
                           retention_ratio=retention_ratio)
    errors = []
    for cap, storage in zip((lower, upper), stores):
        storage.append(cap.key[:, :, prefix:], cap.value[:, :, prefix:], prefix)
        view = storage.view()
        q = cap.query[:, :, prefix:]
        out = sdpa(q, view.keys.to(q.dtype), view.values.to(q.dtype), cap.scaling)
        errors.append(relative_error(out, full_reference(cap, prefix)))
    return PairError(lower=lower.layer_idx, upper=upper.layer_idx, lower_error=errors[0], upper_error=errors[1])


def pair_errors(captures: Sequence[LayerCapture], prefix: int, *, pairs: Sequence[tuple[int, int]] | None = None,
                interpolation: float = DEFAULT_INTERPOLATION,
                retention_ratio: float = DEFAULT_RETENTION_RATIO) -> list[PairError]:
    """:func:`pair_error` of every adjacent pair (default ``(l - 1, l)`` for every l >= 1) of one capture per layer."""
    chosen = pairs if pairs is not None else [(i - 1, i) for i in range(1, len(captures))]
    return [pair_error(captures[lo], captures[hi], prefix, interpolation=interpolation,
                       retention_ratio=retention_ratio) for lo, hi in chosen]
