"""Predicted losses in a study report: each solved policy's predicted loss beside the exact optimum
(:func:`loss_vs_exact`), the profile's additive loss of any plan (:func:`profile_loss`), and how well it ranks the
measured accuracy of the plans at one budget (:func:`predicted_vs_measured`)."""

from __future__ import annotations

from typing import Any

from polykv.errors import SolverError, StudyError
from polykv.plan import Plan
from polykv.profiling import stats


def loss_vs_exact(results, budget: str, profile, *, registry=None) -> list[dict[str, Any]]:
    """Per solved policy at ``budget``: its predicted loss beside the exact optimum of the additive model
    over the same rules (the configs it could choose from, any per-layer mix) and over every rule.

    ``gap`` = predicted / same-rules optimum - 1 (how far a greedy or uniform choice is from optimal).
    """
    from polykv.errors import PolykvError
    from polykv.solvers import solve

    spec = results.header["spec"]
    from polykv.profiling.budget import Budget

    b = Budget.parse(budget, int(spec["context_tokens"]), basis=spec.get("basis", "nominal"),
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
        out.append({"policy": name, "solver": rec.get("solver"), "rules": rules, "loss": loss,
                    "exact_same_rules": same, "exact_all_rules": every,
                    "gap": None if not same else loss / same - 1})
    return out


PREDICTED_VS_MEASURED_MIN = 12
"""Plans at one budget the predicted-vs-measured Spearman asks for before its figure counts as evidence."""


def profile_loss(plan: Plan, profile, context_tokens: int, metric: str | None = None) -> float | None:
    """The profile's additive loss of ``plan``: sum over layers of the table value of the config the layer runs
    (same rule, phase, parameters, widths and kept tokens at ``context_tokens``). A layer that keeps a share of
    the tokens the profile did not measure, of a rule and widths it did, gets the loss linearly interpolated in
    keep between the two profiled keeps around it, as the ``uniform`` solver predicts its own plans
    (:func:`polykv.solvers.uniform.interpolated_loss`; the keep-everything config at those widths closes the
    range). None when a layer runs a setting the profile cannot predict (another rule, parameters or widths, a
    keep below the lowest profiled one), or the plan's allocator decides its capacities at run time."""
    from polykv.plan import FULL_OP, OpSpec

    if plan.allocation or plan.num_layers != profile.num_layers:
        return None
    table = profile.table(metric)
    quant = profile.quantizer_fields()
    total = 0.0
    for lp in plan.layers:
        if (lp.k_bits, lp.v_bits) != (16, 16) and (lp.quantizer, dict(lp.quantizer_params)) != (
                quant["quantizer"], quant["quantizer_params"]):
            return None
        found = None
        for j, c in enumerate(profile.configs):
            if (c.k_bits, c.v_bits) != (lp.k_bits, lp.v_bits):
                continue
            if c.keeps_everything:
                ops = (FULL_OP, FULL_OP)
            else:
                op = OpSpec(rule=c.rule, capacity_ratio=float(c.keep), params=c.params)
                ops = (op if c.phase in ("prefill", "both") else FULL_OP,
                       op if c.phase in ("decode", "both") else FULL_OP)
            if all(_same_op(a, b, context_tokens) for a, b in zip(ops, (lp.prefill, lp.decode))):
                found = j
                break
        loss = float(table[lp.layer, found]) if found is not None else _interpolated(profile, table, lp,
                                                                                       context_tokens)
        if loss is None:
            return None
        total += loss
    return total


def _interpolated(profile, table, lp, context_tokens: int) -> float | None:
    """The loss of layer ``lp`` interpolated in keep between profiled keeps of its rule (see :func:`profile_loss`)."""
    import json

    from polykv.solvers.uniform import Template, interpolated_loss, templates

    ops = [op for op in (lp.prefill, lp.decode) if not op.keeps_everything]
    if not ops or context_tokens < 1 or (len(ops) == 2 and ops[0] != ops[1]):
        return None
    op = ops[0]
    phase = "both" if len(ops) == 2 else ("prefill" if lp.decode.keeps_everything else "decode")
    tpl = Template(op.rule, phase, json.dumps(dict(op.params), sort_keys=True))
    try:
        known = templates(profile, None, "report")
    except SolverError:  # a profile of keep-everything configs only
        return None
    if tpl not in known:
        return None
    keep = min(op.resolve_capacity(context_tokens), context_tokens) / context_tokens
    per_layer = interpolated_loss(profile, table, tpl, lp.k_bits, lp.v_bits, keep)
    return None if per_layer is None else float(per_layer[lp.layer])


def _same_op(a, b, context_tokens: int) -> bool:
    if a.keeps_everything or b.keeps_everything:
        return a.keeps_everything and b.keeps_everything
    return (a.rule == b.rule and dict(a.params) == dict(b.params)
            and a.resolve_capacity(context_tokens) == b.resolve_capacity(context_tokens))


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
    import json

    from polykv.plan.io import parse_plan_dict
    from polykv.studies.combine import executed_plan

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
