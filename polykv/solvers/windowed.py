"""Window-bounded layers in solving: they keep their model's window, and the budget goes to the other layers.

A sliding-window or chunked layer never holds more than ``window - 1`` tokens
(:meth:`polykv.models.geometry.ModelGeometry.token_bound`). Every solver sees only the unbounded layers:
the windowed layers are fixed to the keep-everything 16-bit op (which the runtime holds at their
bound), their bytes are taken off the budget, the solver runs on a profile of the other layers, and
the plan is reassembled in layer order. A byte budget is the whole cache's (the windowed layers'
bytes come off it); a ratio or tokens-per-layer budget applies to the full-attention layers, whose
cache grows with the context (on Gemma 3 at 2k tokens the sliding layers alone are more than half of
the vanilla cache, so no whole-cache 4x exists without compressing inside the windows). Windowed
layers' profile rows are never read, so a profile may leave them unmeasured.
"""

from __future__ import annotations

from typing import Any

import attrs

from polykv.errors import SolverError
from polykv.plan import LayerPlan, Provenance, per_layer_plan
from polykv.profiling.budget import FULL_BITS, Budget, bits_to_bytes, slot_bits

_WINDOWED = ("sliding_attention", "chunked_attention")


def window_bounds(model: Any) -> dict[int, int]:
    """``{layer: token bound}`` of a profile model's window-bounded layers (from its recorded geometry)."""
    geo = getattr(model, "geometry", None) or {}
    types, window = geo.get("layer_types") or (), geo.get("sliding_window")
    if not window or len(types) != model.num_layers:
        return {}
    return {i: max(1, int(window) - 1) for i, t in enumerate(types) if t in _WINDOWED}


def budget_bytes(profile, budget: Budget) -> int:
    """Nominal bytes ``budget`` allows the whole model, window-bounded layers included (as solved here)."""
    bounds = window_bounds(profile.model)
    if not bounds or budget.kind == "bytes":
        return budget.to_bytes(profile.model)
    T = budget.context_tokens
    fixed = sum(min(T, b) for b in bounds.values()) * slot_bits(profile.model, FULL_BITS, FULL_BITS) // 8
    free = attrs.evolve(profile.model, num_layers=profile.model.num_layers - len(bounds))
    return fixed + budget.to_bytes(free)


def _sub_profile(profile, keep: list[int]):
    model = attrs.evolve(profile.model, num_layers=len(keep))
    metrics = {name: table[keep] for name, table in profile.metrics.items()}
    stats = {name: attrs.evolve(t, values=t.values[keep]) for name, t in profile.stats.items()}
    # a pair table names layers of the whole model; full-attention layers between windowed ones are not adjacent
    return attrs.evolve(profile, model=model, metrics=metrics, stats=stats, pairs=None)


def solve_around_windows(solver, profile, budget: Budget, **params: Any):
    """``solver.solve`` on the unbounded layers only, windowed layers kept at their window (module docstring)."""
    bounds = window_bounds(profile.model)
    if not bounds:
        return solver.solve(profile, budget, **params)
    T, L = budget.context_tokens, profile.model.num_layers
    free = [i for i in range(L) if i not in bounds]
    if not free:
        raise SolverError(f"every layer of this model is window-bounded (windows of {max(bounds.values()) + 1} "
                          f"tokens): there is nothing to solve; run the full plan")
    slot16 = slot_bits(profile.model, FULL_BITS, FULL_BITS)
    fixed = sum(min(T, b) for b in bounds.values()) * slot16 // 8
    if budget.kind == "bytes":
        if budget.value <= fixed:
            raise SolverError(f"the {len(bounds)} window-bounded layers alone hold {fixed} bytes at T={T} (16-bit, "
                              f"their model's window), at or over the budget of {int(budget.value)} bytes; raise "
                              f"the budget")
        sub_budget = attrs.evolve(budget, value=int(budget.value) - fixed)  # keeps the basis, batch and dtype
    else:  # a ratio or tokens per layer applies to the full-attention layers, where the context grows
        sub_budget = budget
    sub = solver.solve(_sub_profile(profile, free), sub_budget, **params)
    prov = sub.provenance
    note = (f"{len(bounds)} window-bounded layers kept at their window ({fixed} bytes); "
            f"the other {len(free)} layers solved at {sub_budget.describe()}")
    prov = attrs.evolve(prov, budget=budget.as_dict(),
                        predicted_bytes=None if prov.predicted_bytes is None else prov.predicted_bytes + fixed,
                        note=f"{prov.note}; {note}" if prov.note else note)
    return whole_model_plan(profile.model, sub, provenance=Provenance(**attrs.asdict(prov, recurse=False)))


def whole_model(sub_model: Any):
    """The whole model of a profile model that :func:`solve_around_windows` cut to its unbounded layers, or None
    when ``sub_model`` is not such a cut (its recorded geometry lists as many layers as it has)."""
    types = (getattr(sub_model, "geometry", None) or {}).get("layer_types") or ()
    if len(types) <= sub_model.num_layers:
        return None
    return attrs.evolve(sub_model, num_layers=len(types))


def whole_model_plan(model: Any, sub_plan, *, provenance: Provenance | None = None):
    """The plan of the whole ``model`` (a profile model) from ``sub_plan``, the plan of its unbounded layers in
    order: each window-bounded layer keeps its window (the keep-everything 16-bit op). Allocation groups name
    the same layers, renumbered in the whole model."""
    bounds = window_bounds(model)
    free = [i for i in range(model.num_layers) if i not in bounds]
    solved = iter(sub_plan.layers)
    layers = [LayerPlan(layer=i) if i in bounds else attrs.evolve(next(solved), layer=i)
              for i in range(model.num_layers)]
    plan = per_layer_plan(model, layers, decode_slack=sub_plan.trigger.decode_slack,
                          provenance=sub_plan.provenance if provenance is None else provenance)
    groups = tuple(attrs.evolve(g, layers=tuple(free[i] for i in g.layers)) for g in sub_plan.allocation)
    return attrs.evolve(plan, allocation=groups) if groups else plan
