"""Predicted losses in a study report: each solved policy's predicted loss beside the exact optimum
(:func:`loss_vs_exact`), the profile's additive loss of any plan (:func:`profile_loss`), and how well it ranks the
measured accuracy of the plans at one budget (:func:`predicted_vs_measured`)."""

from __future__ import annotations

import json
from typing import Any

from polykv.errors import PolykvError, StudyError
from polykv.plan import Plan
from polykv.plan.io import parse_plan_dict
from polykv.profiling import stats
from polykv.profiling.budget import Budget
from polykv.solvers import solve
from polykv.solvers.pricing import layer_loss
from polykv.studies.combine import executed_plan

SPEARMAN_CONVENTION = ("Spearman rho(predicted loss, measured score): negative = the prediction ranks the plans "
                       "correctly")
"""The one sign convention of every correlation a report or the demo prints (and states beside it)."""


def loss_vs_exact(results, budget: str, profile, *, registry=None) -> list[dict[str, Any]]:
    """Per solved policy at ``budget``: its predicted loss beside the exact optimum of the additive model
    over the same rules (the configs it could choose from, any per-layer mix) and over every rule.

    ``gap`` = predicted / same-rules optimum - 1 (how far a greedy or uniform choice is from optimal). A plan solved
    for another context length than the study's (its provenance's ``context_tokens``) gets no optimum and no gap,
    only ``skipped``: the line that says why (losses at different lengths do not compare).
    """
    spec = results.header["spec"]
    T = int(spec["context_tokens"])
    b = Budget.parse(budget, T, basis=spec.get("basis", "nominal"),
                     cache_dtype=spec.get("storage_dtype") or spec.get("dtype") or "bfloat16")
    optimum: dict[Any, float | None] = {}

    def exact(rules, metric):
        key = (tuple(rules) if rules else None, metric)
        if key not in optimum:
            try:
                optimum[key] = solve(profile, b, "exact", registry=registry, rules=list(rules) if rules else None,
                                     metric=metric).provenance.predicted_loss
            except PolykvError:
                optimum[key] = None
        return optimum[key]

    out = []
    for name, rec in results.policies.items():
        prov = (rec.get("plan") or {}).get("provenance") or {}
        if rec.get("budget") != budget or rec.get("role") == "placement" or prov.get("predicted_loss") is None:
            continue
        params = prov.get("params") or {}
        rule = params.get("rule")
        rules = [rule] if rule else params.get("rules")
        if isinstance(rules, str):
            rules = [r for r in rules.split(",") if r]
        same, every = exact(rules, params.get("metric")), exact(None, params.get("metric"))
        loss = float(prov["predicted_loss"])
        solved_at = prov.get("context_tokens")
        if solved_at and int(solved_at) != T:
            out.append({"policy": name, "solver": rec.get("solver"), "rules": rules, "loss": loss,
                        "exact_same_rules": None, "exact_all_rules": None, "gap": None,
                        "skipped": f"solved for a {int(solved_at):,}-token context, the study's is {T:,}: its "
                                   f"predicted loss does not compare with an optimum at {T:,} tokens"})
            continue
        out.append({"policy": name, "solver": rec.get("solver"), "rules": rules, "loss": loss,
                    "exact_same_rules": same, "exact_all_rules": every,
                    "gap": None if not same else loss / same - 1, "skipped": None})
    return out


PREDICTED_VS_MEASURED_MIN = 12
"""Plans at one budget the predicted-vs-measured Spearman asks for before its figure counts as evidence."""


def profile_loss(plan: Plan, profile, context_tokens: int, metric: str | None = None) -> float | None:
    """The profile's additive loss of ``plan``: sum over layers of each layer's price
    (:func:`polykv.solvers.pricing.layer_loss`: the table value of the config the layer runs at ``context_tokens``,
    or interpolated between the profiled keeps and widths around it). None when a layer runs a setting the profile
    cannot predict, or the plan's allocator decides its capacities at run time."""
    if plan.allocation or plan.num_layers != profile.num_layers:
        return None
    table = profile.table(metric)
    total = 0.0
    for lp in plan.layers:
        loss = layer_loss(profile, table, lp, context_tokens)
        if loss is None:
            return None
        total += loss
    return total


def predicted_vs_measured(results, task: str, budget: str, profile=None, *, seed: int = 0) -> dict[str, Any] | None:
    """How well the profile's predicted loss ranks the measured accuracy of the plans at ``budget``.

    Each policy with a plan at ``budget`` gets its predicted loss from its provenance (when the plan was solved
    from ``profile`` or from a profile it extends, or no profile is given) or else from ``profile``'s additive model
    (:func:`profile_loss`); plans with neither are listed without one. A policy that runs the same plan as an
    earlier one (``same_plan_as``: a solver that kept its starting plan) is listed but counted once. ``spearman``
    is Spearman's rho between predicted loss and mean score over the distinct plans with a loss (a profile that ranks plans right gives a rho near
    -1), with a one-sided permutation p for "less"; None (and ``note``) with fewer than 3 plans or a constant
    side. None when no plan at the budget has a loss.
    """
    T = int(results.header["spec"].get("context_tokens") or 0)
    rows = []
    seen: dict[str, str] = {}  # executed plan -> the first policy running it
    for name, rec in results.policies.items():
        if rec.get("budget") != budget or not rec.get("plan"):
            continue
        scores = results.scores(name, task)
        if not scores.size:
            continue
        plan = parse_plan_dict(rec["plan"], source=f"{results.path}: policy '{name}'")
        prov = plan.provenance
        loss, source = None, None
        if prov.predicted_loss is not None and (profile is None or prov.profile_fingerprint == profile.fingerprint
                                                or profile.provenance.knows(prov.profile_fingerprint)):
            loss, source = float(prov.predicted_loss), "provenance"
        elif profile is not None:
            loss = profile_loss(plan, profile, T or int(prov.context_tokens or 0))
            source = None if loss is None else "profile"
        same = seen.setdefault(json.dumps(executed_plan(rec["plan"]), sort_keys=True), name)
        rows.append({"policy": name, "solver": prov.solver, "loss": loss, "source": source,
                     "accuracy": float(scores.mean()), "items": int(scores.size),
                     "same_plan_as": None if same == name else same})
    have = [r for r in rows if r["loss"] is not None and r["same_plan_as"] is None]
    if not have:
        return None
    out: dict[str, Any] = {"rows": rows, "n": len(have), "spearman": None, "note": ""}
    try:
        out["spearman"] = stats.spearman([r["loss"] for r in have], [r["accuracy"] for r in have], seed=seed,
                                         alternative="less")
    except StudyError as exc:  # fewer than 3 plans, or a constant side: say why instead of a number
        out["note"] = str(exc)
    return out
