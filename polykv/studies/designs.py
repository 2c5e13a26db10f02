"""Study designs: the policies a spec expands into, and the paired comparisons a report draws from them.

Policies (:func:`build_policies`, before any model loads): the full cache (``full``), each plan file,
and each solver entry at each budget (``<name>@<budget>``); a ``random-placement`` entry with count N
gives N policies ``<name>#<i>@<budget>``, the count-matched placements of its guided route.

Comparisons (all paired over the same items, :mod:`polykv.studies.stats`):

- MoE-nD's ablation chain (arXiv 2604.17695) per budget: ``d_quant`` = 2d - 2d_uniform,
  ``d_evict`` = 2d_hetero - 2d, from the policies whose roles are those names.
- PolyKV's factorial (arXiv 2606.15157) per budget: (homogeneous | routed) x (uniform | allocated).
- PolyKV's controls per budget: the guided route's rank among count-matched random placements with a
  one-sided Monte Carlo p (ranked by ``top-1`` score or by ``kl``,
  :data:`polykv.studies.options.PLACEMENT_METRICS`), and Spearman between each route's predicted loss -S,
  S = sum_l g[l, rule_l] its profile score (g the routing statistic, sign-flipped when lower is better), and
  its measured score, with a permutation p (negative: the profile ranks the routes correctly).
- The fixed-route budget sweep: a profile-route entry's accuracy at every budget (the route is fixed
  by the profile; only the capacity changes).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from polykv.errors import PolykvError, StudyError
from polykv.memory import full_cache_bytes_16bit, held_bytes_per_layer, nominal_bytes, predict_resident
from polykv.models import model_geometry
from polykv.models.geometry import geometry_from_config
from polykv.plan import Plan, Provenance, full_plan, load_plan, validate_plan
from polykv.plan.writing import plan_dict
from polykv.profiling import stats as paired_stats
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.solvers import solve
from polykv.studies import stats
from polykv.studies.options import check_placement_metric
from polykv.studies.spec import FULL_POLICY, ROLES, StudySpec
from polykv.testing import tiny_model


@attrs.define(frozen=True, kw_only=True)
class Policy:
    """One plan the study runs, with where it came from."""

    name: str
    method: str
    """The spec entry (plan name, solver entry name, or ``full``)."""
    budget: str | None
    """Budget the plan was solved at (None for plan files and the full cache)."""
    role: str
    plan: Plan
    solver: str | None = None
    index: int | None = None
    """Placement index of a random-placement policy."""
    guided: str | None = None
    """For placements: the method whose route they control for."""
    profile_score: float | None = None
    """S = sum over layers of the routing statistic of the layer's rule (routes only)."""

    def record(self, geometry, context_tokens: int) -> dict[str, Any]:
        """The ``policy`` line of the results file."""
        nominal = sum(nominal_bytes(self.plan, geometry, context_tokens))
        resident16 = sum(r.resident_bytes for r in predict_resident(self.plan, geometry, context_tokens,
                                                                      dtype_bytes=2))
        held16 = sum(held_bytes_per_layer(self.plan, geometry, context_tokens, dtype_bytes=2))
        full16 = full_cache_bytes_16bit(geometry, context_tokens)
        return {"kind": "policy", "policy": self.name, "method": self.method, "budget": self.budget,
                "role": self.role, "solver": self.solver, "index": self.index, "guided": self.guided,
                "profile_score": self.profile_score, "nominal_bytes": int(nominal),
                "predicted_resident_bytes_16bit": int(resident16), "predicted_held_bytes_16bit": int(held16),
                "full_bytes_16bit": int(full16), "basis": self.plan.provenance.basis,
                "plan": plan_dict(self.plan)}


def _route_score(profile, plan: Plan) -> float | None:
    params = plan.provenance.params or {}
    route, statistic = params.get("route"), params.get("statistic")
    if not route or not statistic:
        return None
    st = profile.stat(statistic)
    col = {c: j for j, c in enumerate(st.columns)}
    sign = 1.0 if st.higher_is_better else -1.0
    return float(sign * sum(st.values[layer, col[rule]] for layer, rule in enumerate(route)))


def _full_plan(spec: StudySpec) -> Plan:
    """The full cache (every token kept at 16 bits on every layer) for the spec's model, from its geometry alone:
    nothing of a plan file (model data, allocation groups, trigger) or of a profile carries over."""
    return attrs.evolve(full_plan(spec_geometry(spec)), provenance=Provenance(note="full cache"))


def build_policies(spec: StudySpec, *, registry=None) -> list[Policy]:
    """Solve every solver entry at every budget and load every plan file (no model needed)."""
    out: list[Policy] = []
    profile = None
    if spec.profile is not None:
        profile = load_profile(spec.profile)
    for name, path in spec.plans.items():
        out.append(Policy(name=name, method=name, budget=None, role=name if name in ROLES else "",
                          plan=load_plan(path, registry=registry)))
    _refuse_measuring_solvers(spec, registry)
    for entry in spec.solvers:
        for b in spec.budgets:
            budget = spec.budget(b)
            indices = [None] if entry.count is None else list(range(entry.count))
            for i in indices:
                params = dict(entry.params)
                name = f"{entry.name}@{b}" if i is None else f"{entry.name}#{i}@{b}"
                if i is not None:
                    params.update(index=i, count=entry.count)
                try:
                    plan = solve(profile, budget, entry.solver, registry=registry, **params)
                except PolykvError as exc:
                    raise StudyError(f"{spec.source}: policy '{name}' (solver '{entry.solver}'): {exc}") from None
                guided = entry.guided
                if i is not None and guided is None:
                    guided = next((s.name for s in spec.solvers if s.solver == "profile-route"), None)
                out.append(Policy(name=name, method=entry.name, budget=b, role=entry.role, plan=plan,
                                  solver=entry.solver, index=i, guided=guided,
                                  profile_score=_route_score(profile, plan)))
    if spec.baseline:  # first in the list, built last: the policies' own errors come before the model's shape
        out.insert(0, Policy(name=FULL_POLICY, method=FULL_POLICY, budget=None, role="full", plan=_full_plan(spec)))
    return out


def _refuse_measuring_solvers(spec: StudySpec, registry) -> None:
    """A study solves its plans before any model loads (bad input fails in seconds), so a solver that measures
    its candidate plans on the model (``refine``) cannot run as a solver entry: say how to run it instead."""
    if registry is None:
        registry = get_registry()
    for entry in spec.solvers:
        if getattr(registry.solver(entry.solver), "needs_model", False):
            b = spec.budgets[0] if spec.budgets else "8x"
            raise StudyError(
                f"{spec.source}: solver entry '{entry.name}' (solver '{entry.solver}') measures its candidate plans "
                "on the model, and a study solves every plan before it loads one: solve it first, e.g. "
                f"`polykv solve PROFILE --budget {b} --context {spec.context_tokens} --basis {spec.basis} "
                f"--cache-dtype {spec.cache_dtype} --solver {entry.solver} --model {spec.model} -o {entry.name}.{b}.plan.json`, and list each file "
                f"under \"plans\" as \"{entry.name}@{b}\"")


# -- comparisons ---------------------------------------------------------------------------------
def _by_role(results, budget: str | None, roles) -> dict[str, str]:
    """role -> policy name at ``budget`` (the full baseline counts at every budget)."""
    out = {}
    for name, rec in results.policies.items():
        role = rec.get("role") or ""
        if role in roles and (rec.get("budget") == budget or role == "full"):
            out.setdefault(role, name)
    return out


def budgets(results) -> list[str]:
    seen = []
    for rec in results.policies.values():
        b = rec.get("budget")
        if b is not None and b not in seen:
            seen.append(b)
    return seen


def plans_at(results, budget: str) -> list[str]:
    """The policies compared at ``budget`` (placements left out): solved there, or plan files whose provenance
    names it (:meth:`polykv.studies.results.Results.load` places them)."""
    return [n for n, r in results.policies.items() if r.get("role") != "placement" and r.get("budget") == budget]


def moend_chain(results, task: str, budget: str, **kw) -> dict[str, Any] | None:
    """MoE-nD's ablation at ``budget``: policies by role and paired intervals; None without 2d roles."""
    roles = _by_role(results, budget, ("full", "1d", "2d_uniform", "2d", "2d_hetero"))
    if not {"2d_uniform", "2d", "2d_hetero"} <= set(roles):
        return None
    scores = {role: results.scores(name, task) for role, name in roles.items()}
    return {"policies": roles, "intervals": stats.moend_ablation(scores, **kw)}


def factorial(results, task: str, budget: str, **kw) -> dict[str, Any] | None:
    """PolyKV's 2 x 2 at ``budget``; None unless all four cells have a policy."""
    roles = _by_role(results, budget, stats.FACTORIAL_CELLS)
    if set(roles) != set(stats.FACTORIAL_CELLS):
        return None
    scores = {role: results.scores(name, task) for role, name in roles.items()}
    return {"policies": roles, "intervals": stats.polykv_factorial(scores, **kw)}


def placement(results, task: str, budget: str, *, seed: int = 0, metric: str = "top-1") -> dict[str, Any] | None:
    """Guided route vs its count-matched random placements at ``budget`` on ``metric``, and the Spearman of the
    profile's prediction against it; None without placements, or on ``kl`` when ``task`` measured no KL.

    The Spearman follows :data:`polykv.studies.predicted.SPEARMAN_CONVENTION`: rho(predicted loss, measured score),
    where the predicted loss is the sign-flipped profile score -S and the measured score is the mean score (top-1)
    or the negated mean KL; negative means the profile ranks the routes correctly.
    """
    check_placement_metric(metric)
    randoms = [n for n, r in results.policies.items() if r.get("role") == "placement" and r.get("budget") == budget]
    if not randoms:
        return None
    method = results.policies[randoms[0]].get("guided")
    guided = next((n for n, r in results.policies.items() if r.get("method") == method
                   and r.get("budget") == budget and r.get("index") is None), None)
    if guided is None:
        return None
    if metric == "kl":
        kl = {n: [r.get("kl") for r in results.results if r["policy"] == n and r["task"] == task]
              for n in [guided] + randoms}
        if any(not v or None in v for v in kl.values()):
            return None
        mean = {n: float(np.mean(v)) for n, v in kl.items()}
    else:
        mean = {n: float(results.scores(n, task).mean()) for n in [guided] + randoms}
    higher = metric != "kl"
    out: dict[str, Any] = {"guided": guided, "random": randoms, "metric": metric, "higher_is_better": higher,
                           "control": stats.placement_control(mean[guided], [mean[n] for n in randoms],
                                                              higher_is_better=higher)}
    names = [n for n in [guided] + randoms if results.policies[n].get("profile_score") is not None]
    x = [-results.policies[n]["profile_score"] for n in names]
    y = [mean[n] if higher else -mean[n] for n in names]
    try:
        out["spearman"] = paired_stats.spearman(x, y, seed=seed, alternative="less")
    except StudyError as exc:  # fewer than 3 routes, or a constant side: say why instead of a number
        out["spearman"] = None
        out["spearman_note"] = str(exc)
    out["profile_scores"] = {n: -v for n, v in zip(names, x)}
    out["mean_scores"] = mean
    return out


def budget_sweep(results, task: str) -> dict[str, list[tuple[str, str]]]:
    """For every profile-route method: [(budget, policy)] across budgets (the route held fixed)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, rec in results.policies.items():
        if rec.get("solver") == "profile-route" and rec.get("budget") is not None:
            out.setdefault(rec["method"], []).append((rec["budget"], name))
    return {m: v for m, v in out.items() if len(v) > 1}


def paired_vs(results, task: str, a: str, b: str, **kw) -> paired_stats.Interval:
    """Paired bootstrap interval of mean(score of a) - mean(score of b) over the shared items."""
    return paired_stats.paired_bootstrap(results.scores(a, task), results.scores(b, task), **kw)


def mean_bytes(results, policy: str, task: str, field: str = "kv_bytes") -> float:
    values = results.field(policy, task, field)
    return float(np.mean(values)) if values.size else float("nan")


def mean_held_bytes(results, policy: str, task: str) -> float:
    """Mean measured bytes the cache held after compressing the context: K/V stores plus metadata."""
    held = [r["kv_bytes"] + r.get("metadata_bytes", 0) for r in results.results
            if r["policy"] == policy and r["task"] == task]
    return float(np.mean(held)) if held else float("nan")


def mean_full16_bytes(results, policy: str, task: str) -> float:
    """Mean bytes of a 16-bit full cache of the same contexts (older results: the run's full cache)."""
    recs = [r for r in results.results if r["policy"] == policy and r["task"] == task]
    if recs and all("full_kv_bytes_16bit" in r for r in recs):
        return float(np.mean([r["full_kv_bytes_16bit"] for r in recs]))
    return mean_bytes(results, policy, task, "full_kv_bytes")


BYTES_TOLERANCE = 0.05
"""Two policies compared at one budget should hold measured bytes within this fraction of each other."""


def unequal_memory(results, task: str, names: list[str], tolerance: float = BYTES_TOLERANCE) -> list[str]:
    """One warning line per pair of ``names`` whose measured bytes (with metadata) differ by more than ``tolerance``."""
    held = {n: mean_held_bytes(results, n, task) for n in names}
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            hi, lo = max(held[a], held[b]), min(held[a], held[b])
            if lo > 0 and hi / lo - 1 > tolerance:
                out.append(f"`{a}` holds {held[a] / held[b]:.2f}x the measured bytes of `{b}` "
                           f"({held[a]:,.0f} vs {held[b]:,.0f} B): not a like-for-like comparison")
    return out


def spec_geometry(spec: StudySpec):
    """The geometry of the spec's model from its config alone (no weights are loaded or downloaded)."""
    if isinstance(spec.model, str):  # "default" or a named model: its config (a named one converted once, cached)
        return model_geometry(spec.model)
    try:
        return geometry_from_config(tiny_model(**dict(spec.model["tiny"])).config)
    except (TypeError, ValueError) as exc:
        raise StudyError(f"{spec.source}: field 'model.tiny': {exc}") from None


def check_policies_fit(spec: StudySpec, policies: list[Policy], *, registry=None) -> list[str]:
    """Check every policy's plan against the spec's model shape before the model loads; return warnings.

    Plan files and solved plans are checked before the full baseline (built from the model itself), so a plan
    made for another model is blamed by its own file.
    """
    geo = spec_geometry(spec)
    ordered = [p for p in policies if p.name != FULL_POLICY] + [p for p in policies if p.name == FULL_POLICY]
    for pol in ordered:
        source = spec.plans.get(pol.name) or f"{spec.source}: policy '{pol.name}'"
        validate_plan(pol.plan, registry=registry, geometry=geo, source=source)
    notes = []
    longest = [("context_tokens", spec.context_tokens)] + [
        (f"tasks[{i}].params.{k}", t.params[k]) for i, t in enumerate(spec.tasks)
        for k in ("length", "context_tokens") if isinstance(t.params.get(k), int)]
    if geo.max_positions:
        for field, n in longest:
            if n > geo.max_positions:
                notes.append(f"{spec.source}: field '{field}': {n} tokens exceed the model's "
                             f"{geo.max_positions} positions (max_position_embeddings); the model was not trained "
                             "on positions that far, so scores there measure extrapolation")
    return notes
