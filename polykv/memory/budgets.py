"""What a memory budget counts: the 16-bit full-cache ratio basis and the bytes a layer holds at its peak over
phases, on a budget basis (:data:`polykv.plan.BASES`: ``resident`` = bytes the runtime holds, stores + metadata,
the peak over phases; ``nominal`` = MoE-nD's formula, codes only, at the decode bound) in a storage dtype
(:data:`polykv.plan.STORAGE_DTYPE_BYTES`)."""

from __future__ import annotations

from typing import Any

import attrs

from polykv.errors import PlanError
from polykv.memory.resident import predict_resident
from polykv.memory.tokens import MEMORY_PHASES
from polykv.plan import BASES, STORAGE_DTYPE_BYTES, LayerPlan


def full_cache_bytes_16bit(geometry: Any, context_tokens: int, batch: int = 1) -> int:
    """Bytes of the uncompressed 16-bit K+V cache vanilla transformers holds after ``context_tokens`` (the
    ratio basis): every full-attention layer holds them all, a window-bounded layer at most its window."""
    if hasattr(geometry, "full_cache_bytes"):
        return int(geometry.full_cache_bytes(int(context_tokens), batch=int(batch), dtype_bytes=2))
    return 4 * int(geometry.num_layers) * int(geometry.num_kv_heads) * int(geometry.head_dim) \
        * int(context_tokens) * int(batch)


def held_bytes_per_layer(plan: Any, geometry: Any, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                         registry: Any = None, num_heads: int | None = None) -> list[int]:
    """Per layer, the most bytes the runtime holds for a ``context_tokens`` prompt: key + value stores
    plus metadata, the larger of the two phases (right after prefill, and the decode bound).

    A decode-only eviction rule holds the whole prompt right after prefill, so it does not lower this
    peak. Raises :class:`PlanError` when metadata cannot be counted (a query window without ``num_heads``).
    """
    phases = [predict_resident(plan, geometry, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                               registry=registry, phase=ph, num_heads=num_heads) for ph in MEMORY_PHASES]
    out = []
    for rows in zip(*phases):
        if any(None in r.metadata.values() for r in rows):
            raise PlanError("a decode rule keeps a query window, but the model's number of query heads is unknown",
                            layer=rows[0].layer, field="model.num_heads",
                            hint="give the geometry's num_heads (profiles record it when calibrated on a model)")
        out.append(max(r.resident_bytes + r.metadata_bytes for r in rows))
    return out


@attrs.define(frozen=True)
class _OneLayer:
    layers: tuple


@attrs.define(frozen=True)
class _OneLayerGeometry:
    num_kv_heads: int
    head_dim: int
    num_heads: int | None
    num_layers: int = 1


def layer_held_bytes(layer: LayerPlan, geometry: Any, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                     registry: Any = None) -> int:
    """:func:`held_bytes_per_layer` of one layer (``geometry`` needs ``num_kv_heads``, ``head_dim``,
    and ``num_heads`` when a decode rule keeps a query window)."""
    geo = _OneLayerGeometry(num_kv_heads=int(geometry.num_kv_heads), head_dim=int(geometry.head_dim),
                            num_heads=getattr(geometry, "num_heads", None))
    return held_bytes_per_layer(_OneLayer(layers=(attrs.evolve(layer, layer=0),)), geo, context_tokens, batch=batch,
                                dtype_bytes=dtype_bytes, registry=registry)[0]


def pair_held_bytes(geometry: Any, context_tokens: int, share_params: Any = None, *, batch: int = 1,
                    dtype_bytes: int = 2, registry: Any = None) -> int:
    """:func:`held_bytes_per_layer` of a shared layer pair (``LayerPlan.share``, both layers keeping every token at
    16 bits, ``share_params`` of the upper layer), both layers together."""
    geo = _OneLayerGeometry(num_kv_heads=int(geometry.num_kv_heads), head_dim=int(geometry.head_dim),
                            num_heads=getattr(geometry, "num_heads", None), num_layers=2)
    pair = _OneLayer(layers=(LayerPlan(layer=0), LayerPlan(layer=1, share=0, share_params=dict(share_params or {}))))
    return sum(held_bytes_per_layer(pair, geo, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                                    registry=registry))


def context_note(plan: Any, context_tokens: int, *, registry: Any = None) -> str | None:
    """One line when ``plan`` keeps absolute token capacities and runs on a context other than the one
    its budget was stated for (``plan.provenance.context_tokens``): the share of a 16-bit full cache it
    really holds there (bfloat16 storage, metadata included) beside the share at the budgeted length.
    None when capacities are ratios, the lengths agree, or the plan records no context or model.
    """
    budgeted = getattr(getattr(plan, "provenance", None), "context_tokens", None)
    geo = getattr(plan, "model", None)
    absolute = any(not op.keeps_everything and op.capacity is not None
                   for lp in plan.layers for op in (lp.prefill, lp.decode))
    if not absolute or not budgeted or geo is None or int(budgeted) == int(context_tokens):
        return None

    def ratio(T: int) -> float:
        rows = predict_resident(plan, geo, T, registry=registry)
        held = sum(r.resident_bytes + r.metadata_bytes for r in rows)
        return full_cache_bytes_16bit(geo, T) / held

    return (f"this plan keeps absolute token capacities budgeted for a {budgeted:,}-token context but runs on "
            f"{context_tokens:,} tokens: it holds {ratio(context_tokens):.2f}x less than a 16-bit full cache here "
            f"(with metadata), {ratio(int(budgeted)):.2f}x at {budgeted:,} tokens; solve with ratio capacities "
            f"to keep the compression at any length")
