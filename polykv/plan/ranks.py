"""The checks of a plan's ranks (``k_rank`` / ``v_rank``, see ``docs/low-rank.md``), run only when some layer has one.

A rank is a schema version 2 field, fits the head dim (the plan's own, then the model's) and is a width the layer's
quantizer can code. Every error is a :class:`polykv.errors.PlanError` naming the file, the layer and the field.
"""

from __future__ import annotations

from polykv.errors import PlanError
from polykv.plan.records import PASSTHROUGH_BITS, RANK_SCHEMA_VERSION, LayerPlan, ModelInfo, Plan
from polykv.plan.writing import RANK_FIELDS
from polykv.strict_json import FieldReader


def check_rank_version(r: FieldReader, version: int, layers: list[LayerPlan], model: ModelInfo | None) -> None:
    """Ranks need schema version 2 and fit the plan's head dim."""
    for lp in layers:
        for name in RANK_FIELDS:
            rank = getattr(lp, name)
            if rank is None:
                continue
            field = f"layers[{lp.layer}].{name}"
            if version < RANK_SCHEMA_VERSION:
                r.fail(f"'{name}' is a schema version {RANK_SCHEMA_VERSION} field but the file says version {version}",
                       layer=lp.layer, field=field, hint=f"set \"schema_version\": {RANK_SCHEMA_VERSION}, or remove "
                       f"the rank (full rank)")
            if model is not None and rank > model.head_dim:
                r.fail(f"rank {rank} exceeds the head dim {model.head_dim}", layer=lp.layer, field=field,
                       hint=f"use a rank in 1..{model.head_dim}, or remove it for full rank")


def check_ranks(plan: Plan, head_dim: int, source: str) -> None:
    """Every rank fits the model's head dim."""
    for lp in plan.layers:
        for name in RANK_FIELDS:
            rank = getattr(lp, name)
            if rank is not None and rank > head_dim:
                raise PlanError(f"rank {rank} exceeds the model's head dim {head_dim}", source=source, layer=lp.layer,
                                field=f"layers[{lp.layer}].{name}",
                                hint=f"use a rank in 1..{head_dim}, or remove it for full rank")


def check_code_widths(lp: LayerPlan, quantizer, source: str) -> None:
    """The layer's quantizer can code its ranks' widths (:meth:`~polykv.contract.stores.Quantizer.check_width`)."""
    for stream, name, bits in (("key", "k_rank", lp.k_bits), ("value", "v_rank", lp.v_bits)):
        rank = getattr(lp, name)
        if rank is None or bits == PASSTHROUGH_BITS:
            continue
        try:
            quantizer.check_width(stream, bits, rank)
        except ValueError as exc:
            raise PlanError(f"{name} {rank}: {exc}", source=source, layer=lp.layer, field=f"layers[{lp.layer}].{name}",
                            hint="choose a rank the quantizer accepts (see docs/low-rank.md), or other "
                                 "quantizer_params") from None
