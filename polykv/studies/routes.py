"""What each layer of a study's plans kept: the rows of the report's route figure.

A plan's layers keep the tokens their capacities resolve to at the items' mean context, except where an allocator
decides at run time: there the capacities are its bound, and the figure shows what it kept, from the measured
bytes per layer (:func:`allocated_kept`).
"""

from __future__ import annotations

import numpy as np

from polykv.memory import kept_tokens, predict_resident
from polykv.plan import STORAGE_DTYPE_BYTES
from polykv.plan.io import parse_plan_dict
from polykv.studies.results import Results


def route_rows(res: Results, budget: str | None) -> tuple[list[dict], int]:
    """Per plan at ``budget`` (placements left out): per layer its rule, tokens kept at the items' mean context T,
    and K/V widths; and T."""
    T = int(res.header["spec"].get("context_tokens", 0))
    T = int(np.mean([r["context_tokens"] for r in res.results])) if res.results else T
    rows = []
    for name, rec in res.policies.items():
        if rec.get("budget") != budget or rec.get("role") == "placement" or not rec.get("plan"):
            continue
        plan = parse_plan_dict(rec["plan"], source=f"{res.path}: policy '{name}'")
        kept = allocated_kept(res, name, plan, T) if plan.allocation else None
        layers = []
        for lp in plan.layers:
            rule = lp.prefill.rule if not lp.prefill.keeps_everything else lp.decode.rule
            layers.append({"rule": rule, "kept": kept[lp.layer] if kept else kept_tokens(lp, T), "k_bits": lp.k_bits,
                           "v_bits": lp.v_bits})
        rows.append({"name": name, "layers": layers})
    return rows, T


def allocated_kept(res: Results, name: str, plan, T: int) -> list[float] | None:
    """Per layer the tokens an allocator plan really kept, from the measured bytes per layer: each layer's planned
    tokens scaled by its measured bytes over the bytes the memory model predicts at the planned capacity (the
    plan's capacities are the allocator's bound, not what it kept). None when the results carry no per-layer
    bytes."""
    measured = [r["kv_bytes_per_layer"] for r in res.results if r["policy"] == name and r.get("kv_bytes_per_layer")]
    if not measured or plan.model is None or len(measured[0]) != plan.num_layers:
        return None
    spec = res.header["spec"]
    size = STORAGE_DTYPE_BYTES.get(spec.get("storage_dtype") or spec.get("dtype"), 2)
    planned = {i: {"budget": kept_tokens(plan.layers[i], T)} for g in plan.allocation for i in g.layers}
    predicted_rows = predict_resident(plan, plan.model, T, dtype_bytes=size, allocations=planned)
    mean = np.mean(np.array(measured, float), axis=0)
    return [min(float(T), kept_tokens(lp, T) * mean[lp.layer] / row.resident_bytes) if lp.layer in planned
            and row.resident_bytes else kept_tokens(lp, T) for lp, row in zip(plan.layers, predicted_rows)]
