"""Solvers: turn a Profile and a budget into a Plan.

>>> plan = solve(profile, Budget.parse("8x", 4096), solver="exact")  # doctest: +SKIP

Built-in solvers (``polykv.solvers.builtin.SOLVERS``): ``uniform``, ``moend-greedy``, ``quant-only``,
``exact``, ``pyramid``, ``profile-route``, ``random-placement``, ``refine`` (measures its plans on a model),
``global`` (an allocation group over layers x heads).
See ``docs/solvers.md``.
"""

from __future__ import annotations

from typing import Any, Mapping

from polykv.errors import SolverError
from polykv.registry import get_registry
from polykv.solvers.windowed import solve_around_windows


def solve(profile, budget, solver: str = "exact", *, geometry=None, registry=None, capacities: str = "ratio",
          quantizer: str | None = None, quantizer_params: Mapping[str, Any] | None = None, model=None,
          **params: Any):
    """Run the registered solver ``solver`` on ``profile`` at ``budget``.

    ``geometry`` (a :class:`polykv.models.geometry.ModelGeometry`), when given, must be the model the
    profile was measured on (else :class:`polykv.errors.ProfileError`). Window-bounded layers
    (sliding-window, chunked) keep their model's window and the budget goes to the other layers
    (:mod:`polykv.solvers.windowed`).
    (default) writes every capacity as a fraction of the context, so the plan keeps its compression
    at any length; ``"tokens"`` writes token counts for the budget's context.

    Quantized layers use the quantizer the profile was calibrated with (``profile.quantizer``), and
    are budgeted with its byte model. ``quantizer`` / ``quantizer_params``, when given, state the
    quantizer the plan must use: one other than the profile's is a :class:`~polykv.errors.SolverError`.

    ``model`` (a :class:`polykv.solvers.refine.MeasureOn`) is the model a measuring solver (``refine``) runs its
    candidate plans on; such a solver without one is a :class:`~polykv.errors.SolverError`, and the other
    solvers never read it.
    """
    if quantizer is not None or quantizer_params is not None:
        want = (quantizer or profile.quantizer, dict(profile.quantizer_params if quantizer_params is None
                                                     else quantizer_params))
        if want != (profile.quantizer, dict(profile.quantizer_params)):
            raise SolverError(f"{profile.source}: the profile was calibrated with quantizer '{profile.quantizer}'"
                              f"{' ' + str(dict(profile.quantizer_params)) if profile.quantizer_params else ''}, "
                              f"not '{want[0]}'{' ' + str(want[1]) if want[1] else ''}: its losses and byte costs "
                              f"describe its own quantizer; calibrate a profile with it (polykv calibrate --quantizer "
                              f"{want[0]}), or leave the quantizer unset")
    if registry is None:
        registry = get_registry()
    if geometry is not None:
        profile.check_model(geometry)
    if capacities not in ("ratio", "tokens"):
        raise SolverError(f"capacities must be 'ratio' or 'tokens', got {capacities!r}")
    instance = registry.solver(solver)(registry=registry)
    instance.capacity_form = capacities
    if getattr(instance, "needs_model", False):
        if model is None:
            raise SolverError(f"solver '{solver}' measures its candidate plans on the model and needs one: pass "
                              "--model default (or a model folder) to polykv solve, or "
                              "solve(..., model=polykv.solvers.refine.MeasureOn(model=..., tokenizer=...))")
        instance.measure_on = model
    seen = profile if getattr(instance, "routes_axes", False) else profile.without_axes()
    plan = solve_around_windows(instance, seen, budget, **params)
    return with_metric_note(plan, profile, instance, params)


def with_metric_note(plan, profile, solver, params: Mapping[str, Any]):
    """``plan`` whose provenance note says which metric table ``solver`` routed on (for solvers with a
    ``metric`` parameter): the one asked for, else the profile's routing metric. A profile that records no
    routing metric (every profile of before) and no metric asked for: the plan is left as it was (l2)."""
    import attrs

    asked = params.get("metric")
    if "metric" not in getattr(solver, "defaults", {}) or (asked is None and profile.routing_metric is None):
        return plan
    metric = asked or profile.default_metric
    text = f"routed on metric '{metric}' ({'asked for' if asked else 'the profile routing metric'})"
    prov = plan.provenance
    note = f"{prov.note}; {text}" if prov.note else text
    return attrs.evolve(plan, provenance=attrs.evolve(prov, note=note))
