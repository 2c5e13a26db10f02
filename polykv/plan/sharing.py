"""The checks of a plan's shared layer pairs (``LayerPlan.share``, see ``docs/sharing.md``).

A pair is (lower ``l - 1``, upper ``l``), named on the upper layer. Supported: both layers keep every token at 16
bits (rule ``full`` in both phases, no quantization, no allocation group), both full-attention layers of the
same attention type; the lower layer is not itself the upper layer of a pair. Everything else is refused here,
in one line naming the layer and field, before any model runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from polykv.errors import PlanError
from polykv.plan.records import SCHEMA_VERSION, SHARE_SCHEMA_VERSION
from polykv.storage.layer_share import SHARE_PARAMS


def check_share_params(params: dict[str, Any], *, layer: int, source: str) -> None:
    """``share_params``: known names, each a number in [0, 1]."""
    field = f"layers[{layer}].share_params"
    for name, value in params.items():
        if name not in SHARE_PARAMS:
            raise PlanError(f"unknown share parameter '{name}' (known: {sorted(SHARE_PARAMS)})", source=source,
                            layer=layer, field=f"{field}.{name}", hint="remove it or correct its name")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                or not 0.0 <= value <= 1.0:
            raise PlanError(f"{name} must be a number in [0, 1], got {value!r}", source=source, layer=layer,
                            field=f"{field}.{name}", hint=f"e.g. {SHARE_PARAMS[name]} (the default)")


def check_shares(plan, *, source: str = "<plan>", geometry=None) -> None:
    """Every ``share`` names an adjacent, unshared lower layer, and both layers of the pair are supported."""
    layers = plan.layers
    for lp in layers:
        if lp.share is None:
            if lp.share_params:
                raise PlanError("share_params given without share", source=source, layer=lp.layer,
                                field=f"layers[{lp.layer}].share_params",
                                hint=f"set \"share\": {lp.layer - 1} or remove share_params")
            continue
        field = f"layers[{lp.layer}].share"
        if isinstance(lp.share, bool) or not isinstance(lp.share, int) or lp.share != lp.layer - 1:
            raise PlanError(f"share must name the layer below ({lp.layer - 1}): pairs are adjacent layers, got "
                            f"{lp.share!r}", source=source, layer=lp.layer, field=field,
                            hint=f"set \"share\": {lp.layer - 1} or remove it" if lp.layer else "layer 0 has no layer "
                            "below: remove share")
        lower = layers[lp.share]
        if lower.share is not None:
            raise PlanError(f"layer {lower.layer} is itself shared with layer {lower.share}; a layer belongs to one "
                            f"pair", source=source, layer=lp.layer, field=field,
                            hint=f"pair layers {lower.share}-{lower.layer} or {lower.layer}-{lp.layer}, not both")
        check_share_params(lp.share_params, layer=lp.layer, source=source)
        for member in (lower, lp):
            _check_member(plan, member, lp.layer, source)
        if geometry is not None:
            _check_geometry(geometry, lower.layer, lp.layer, source)


def check_share_version(plan, *, source: str) -> None:
    """A version-1 file holds no field of version 2 (``share``)."""
    if plan.schema_version == SCHEMA_VERSION:
        for lp in plan.layers:
            if lp.share is not None or lp.share_params:
                raise PlanError(f"share needs schema_version {SHARE_SCHEMA_VERSION}, but the file says "
                                f"{SCHEMA_VERSION}", source=source, layer=lp.layer, field=f"layers[{lp.layer}].share",
                                hint=f"set \"schema_version\": {SHARE_SCHEMA_VERSION} (polykv writes it for plans "
                                "that share)")


def _check_member(plan, member, upper: int, source: str) -> None:
    where = f"layer {member.layer} of the pair {upper - 1}-{upper}"
    for phase in ("prefill", "decode"):
        op = getattr(member, phase)
        if not op.keeps_everything:
            raise PlanError(f"{where} runs rule '{op.rule}' in {phase}; a shared pair keeps every token (eviction "
                            f"in a shared pair is not supported)", source=source, layer=member.layer,
                            field=f"layers[{member.layer}].{phase}.rule",
                            hint="give both layers of the pair rule 'full', or remove share")
    for name in ("k_bits", "v_bits"):
        if getattr(member, name) != 16:
            raise PlanError(f"{where} stores {name} = {getattr(member, name)}; a shared pair is stored at 16 bits "
                            f"(quantized shared pairs are not supported)", source=source, layer=member.layer,
                            field=f"layers[{member.layer}].{name}", hint="set 16, or remove share")
    for name in ("k_rank", "v_rank"):
        if getattr(member, name) is not None:
            raise PlanError(f"{where} stores {name} = {getattr(member, name)}; a shared pair merges full-width K/V "
                            f"(low-rank codes of two layers lie on different bases)", source=source,
                            layer=member.layer, field=f"layers[{member.layer}].{name}",
                            hint="remove the rank, or remove share")
    if plan.group_of(member.layer) is not None:
        raise PlanError(f"{where} is in allocation group {plan.group_of(member.layer).describe()}; shared layers "
                        f"keep every token and take no allocated budget", source=source, layer=member.layer,
                        field="allocation", hint="remove the layer from the group, or remove share")


def _check_geometry(geometry, lower: int, upper: int, source: str) -> None:
    types = getattr(geometry, "layer_types", None)
    if types is None:
        return
    if types[lower] != types[upper]:
        raise PlanError(f"layers {lower} and {upper} attend differently ({types[lower]} vs {types[upper]}): a pair "
                        f"must share one attention type and rotary setting", source=source, layer=upper,
                        field=f"layers[{upper}].share", hint="pair two layers of the same attention type")
    is_windowed = getattr(geometry, "is_windowed", None)
    if is_windowed is not None and (is_windowed(lower) or is_windowed(upper)):
        raise PlanError(f"layers {lower}-{upper} are {types[upper]} layers with a window bound; sharing windowed "
                        f"layers is not supported", source=source, layer=upper, field=f"layers[{upper}].share",
                        hint="pair two full-attention layers")
