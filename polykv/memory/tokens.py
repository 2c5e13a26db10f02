"""Tokens a plan's layer holds at a context length and phase, and MoE-nD's nominal bytes of them.

The rules (capacities, decode slack, window-bounded layers) are described in :mod:`polykv.memory`.
"""

from __future__ import annotations

from typing import Any

from polykv.errors import PlanError
from polykv.plan import LayerPlan

MEMORY_PHASES = ("prefill", "decode")


def plan_geometry(plan: Any, geometry: Any) -> Any:
    """``geometry``, or the plan's ``model`` record when None; a PlanError when neither exists or the layer
    counts disagree."""
    geo = geometry if geometry is not None else getattr(plan, "model", None)
    if geo is None:
        raise PlanError("no model geometry: the plan has no 'model' record and none was given", field="model",
                        hint="pass a geometry (polykv.models.geometry.geometry_from_config(config)) or a plan with a model")
    n = len(plan.layers)
    if int(geo.num_layers) != n:
        raise PlanError(f"the plan has {n} layers but the model geometry has {geo.num_layers}", field="layers",
                        hint="use a plan made for this model")
    return geo


def check_context(context_tokens: int, phase: str) -> None:
    """A ValueError unless ``context_tokens`` is a positive integer and ``phase`` a memory phase."""
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive integer, got {context_tokens!r}")
    if phase not in MEMORY_PHASES:
        raise ValueError(f"phase must be one of {MEMORY_PHASES}, got {phase!r}")


def kept_tokens(layer: LayerPlan, context_tokens: int, phase: str = "prefill", *, bound: int | None = None) -> int:
    """Tokens a layer holds for a ``context_tokens`` context in ``phase`` (see :mod:`polykv.memory`).

    ``bound``: the layer's own token bound (a window-bounded layer), or None.
    """
    check_context(context_tokens, phase)
    kept = layer.prefill.kept_tokens(context_tokens)
    if phase == "decode" and not layer.decode.keeps_everything:
        kept = layer.decode.kept_tokens(context_tokens)
    return kept if bound is None else min(kept, bound)


def layer_bounds(geometry: Any, num_layers: int) -> list[int | None]:
    """Per layer the token bound of a window-bounded layer, None elsewhere (all None without layer types)."""
    bound = getattr(geometry, "token_bound", None)
    if not callable(bound) or not getattr(geometry, "layer_types", None):
        return [None] * num_layers
    return [bound(i) for i in range(num_layers)]


def nominal_bytes(plan: Any, geometry: Any, context_tokens: int, *, phase: str = "prefill") -> list[int]:
    """MoE-nD nominal bytes per layer: ``kept * Hkv * (d_k * k_bits + d_v * v_bits) / 8`` (rounded up to a
    byte), ``d_k``, ``d_v`` the stored channels (the head dim, or a low-rank layer's ``k_rank``, ``v_rank``).

    ``geometry`` needs ``num_layers``, ``num_kv_heads``, ``head_dim``; None uses ``plan.model``.
    """
    geo = plan_geometry(plan, geometry)
    Hkv, d = int(geo.num_kv_heads), int(geo.head_dim)
    bounds = layer_bounds(geo, len(plan.layers))
    return [-(-kept_tokens(lp, context_tokens, phase, bound=b) * Hkv * code_bits(lp, d) // 8)
            for lp, b in zip(plan.layers, bounds)]


def code_bits(lp: LayerPlan, head_dim: int) -> int:
    """Bits of one token's key and value codes per KV head: ``d_k * k_bits + d_v * v_bits``."""
    return lp.rank_of("key", head_dim) * lp.k_bits + lp.rank_of("value", head_dim) * lp.v_bits



def decode_held_tokens(layer: LayerPlan, context_tokens: int, *, decode_slack: int,
                       new_tokens: int | None = None, after_prefill: int | None = None) -> tuple[int, int]:
    """(fewest, most) tokens per KV head a layer's stores hold after a decode forward (see
    :mod:`polykv.memory`); ``after_prefill`` overrides the prefill op's count (an allocator's budget)."""
    check_context(context_tokens, "decode")
    n = int(new_tokens or 0)
    if after_prefill is None:
        after_prefill = layer.prefill.kept_tokens(context_tokens)
    if layer.decode.keeps_everything:  # after k >= 1 decode forwards of one token each
        return after_prefill + min(n, 1), after_prefill + n
    cap = layer.decode.resolve_capacity(context_tokens + n)
    most = cap + int(decode_slack)
    if new_tokens is not None:
        most = min(most, after_prefill + n)
    return min(cap, after_prefill), max(most, min(cap, after_prefill))

