"""Plan files, written: deterministic JSON text that diffs well and round-trips byte for byte.

The writer reads a plan's records by their fields and needs nothing of :mod:`polykv.plan.records`, which
calls it (:meth:`Plan.to_json`, :meth:`Plan.save`); reading a file back is :mod:`polykv.plan.io`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs

from polykv.atomic import write_text_atomic
from polykv.errors import PlanError

if TYPE_CHECKING:
    from polykv.plan.records import AllocationGroup, LayerPlan, OpSpec, Plan, Provenance

RANK_FIELDS = ("k_rank", "v_rank")
"""Layer fields of schema version 2: channels of the stored key and value codes (absent = full rank)."""
OPTIONAL_PROVENANCE = ("basis", "batch", "cache_dtype", "measured")
"""Provenance fields written only when set (older plan files lack them and round-trip unchanged)."""


def _op_dict(op: OpSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": op.rule}
    if op.capacity is not None:
        out["capacity"] = op.capacity
    if op.capacity_ratio is not None:
        out["capacity_ratio"] = op.capacity_ratio
    if op.params:
        out["params"] = dict(sorted(op.params.items()))
    return out


def layer_dict(lp: LayerPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": lp.layer, "prefill": _op_dict(lp.prefill), "decode": _op_dict(lp.decode),
                           "k_bits": lp.k_bits, "v_bits": lp.v_bits, "quantizer": lp.quantizer}
    if lp.quantizer_params:
        out["quantizer_params"] = dict(sorted(lp.quantizer_params.items()))
    if lp.share is not None:  # schema version 2 (polykv.plan.sharing)
        out["share"] = lp.share
    if lp.share_params:
        out["share_params"] = dict(sorted(lp.share_params.items()))
    for name in RANK_FIELDS:  # written only when set: a full-rank layer's line is what version 1 wrote
        if getattr(lp, name) is not None:
            out[name] = getattr(lp, name)
    return out


def groups_to_json(groups: tuple[AllocationGroup, ...]) -> list[dict[str, Any]]:
    """The ``allocation`` list of a plan file (:mod:`polykv.plan.groups`)."""
    out = []
    for g in groups:
        row: dict[str, Any] = {"allocator": g.allocator, "layers": list(g.layers)}
        if g.params:
            row["params"] = dict(sorted(g.params.items()))
        out.append(row)
    return out


def provenance_dict(provenance: Provenance) -> dict[str, Any]:
    """The ``provenance`` object of a plan file: every field, the optional ones only when set."""
    return {k: v for k, v in attrs.asdict(provenance).items() if v is not None or k not in OPTIONAL_PROVENANCE}


def plan_dict(plan: Plan, folder: str | None = None) -> dict[str, Any]:
    """The plan as JSON data; ``model_data`` paths relative to ``folder`` when given (the plan file's folder)."""
    out = {
        "schema_version": plan.written_schema_version,
        "model": attrs.asdict(plan.model) if plan.model else None,
        "trigger": attrs.asdict(plan.trigger),
        "provenance": provenance_dict(plan.provenance),
        "layers": [layer_dict(lp) for lp in plan.layers],
    }
    if plan.allocation:
        out["allocation"] = groups_to_json(plan.allocation)
    if plan.model_data:
        out["model_data"] = {k: _relative(v, folder) for k, v in sorted(plan.model_data.items())}
    return out


def _relative(path: str, folder: str | None) -> str:
    """``path`` as written in a plan file in ``folder`` (forward slashes); unchanged without a folder."""
    if folder is None:
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(folder)).replace(os.sep, "/")


def _check_json(value: Any, field: str) -> None:
    """Refuse what a plan file cannot hold (a set, an object), naming its field, before any JSON is written."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(v, f"{field}.{k}" if field else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{field}[{i}]")
    else:
        raise PlanError(f"{field} holds a {type(value).__name__} ({value!r}), which a plan file cannot hold",
                        field=field, hint="give a number, a string, true/false, null, a list or a mapping")


def dumps(plan: Plan, folder: str | None = None) -> str:
    """Stable text: one top-level field per line, one layer per line, trailing newline."""
    d = plan_dict(plan, folder)
    _check_json(d, "")
    enc = lambda v: json.dumps(v, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)  # noqa: E731
    lines = ["{"]
    for key in ("schema_version", "model", "trigger", "provenance", "allocation", "model_data"):
        if key in d:
            lines.append(f'  "{key}": {enc(d[key])},')
    lines.append('  "layers": [')
    rows = [f"    {enc(row)}" for row in d["layers"]]
    lines.append(",\n".join(rows))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save(plan: Plan, path: str) -> None:
    """Write ``plan`` to ``path`` atomically (temp file + rename), ``model_data`` relative to its folder."""
    write_text_atomic(path, dumps(plan, os.path.dirname(os.path.abspath(path))))
