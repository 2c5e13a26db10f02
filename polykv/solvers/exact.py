"""``exact``: the provably optimal plan for the additive loss model.

Under the additive model of MoE-nD (arXiv 2604.17695) a plan's loss is sum_l S[l, c_l] and its
nominal size is sum_l m(c_l); choosing one config per layer to minimise the loss within the budget
is a multiple-choice knapsack, solved exactly by :func:`polykv.solvers.mckp.solve_mckp` (Pareto
dynamic programming with linear-relaxation bounds; the optimality argument is in that module and in
``docs/solvers.md``). Unlike ``moend-greedy`` it needs no keep x K x V grid and may mix rules and
phases: every config the profile lists is a candidate on every layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polykv.errors import SolverError
from polykv.plan import FULL_OP
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate_axes import pair_losses
from polykv.profiling.profile import Profile
from polykv.profiling.profile_checks import MIX_METRIC
from polykv.solvers.base import METRIC_SPEC, Solver, config_bits, min_bytes_message
from polykv.solvers.chain import PAIRED, solve_chain
from polykv.solvers.mckp import Infeasible, solve_mckp


def candidate_columns(solver: Solver, profile: Profile, rules: Any) -> np.ndarray:
    """Config columns allowed by ``rules`` (None = all; keep-1.0 configs always stay), phase-checked."""
    if rules is not None:
        missing = sorted(set(rules) - {c.rule for c in profile.configs})
        if missing:
            raise SolverError(f"solver '{solver.name}': parameter 'rules' names {missing}, of which the profile has "
                              f"no configs; it has {sorted({c.rule for c in profile.configs})}")
    cols = [i for i, c in enumerate(profile.configs)
            if rules is None or c.rule in rules or c.keeps_everything]
    if not cols:
        raise SolverError(f"solver '{solver.name}': no config of rules {rules} in the profile; it has "
                          f"{sorted({c.rule for c in profile.configs})}")
    solver.check_configs(profile, cols)
    return np.asarray(cols, np.int64)


def optimal_columns(solver: Solver, profile: Profile, budget: Budget, table: np.ndarray, cols: np.ndarray,
                    what: str) -> tuple[list[int], float, int]:
    """Optimal column per layer among ``cols``; (columns, loss, bits). Fails with the minimum budget."""
    bits = config_bits(profile, budget, solver)
    try:
        choice, loss, used = solve_mckp(table[:, cols], bits[cols], budget.to_bits(profile.model))
    except Infeasible as exc:
        raise SolverError(min_bytes_message(solver.name, exc.need, budget, what)) from None
    return [int(cols[c]) for c in choice], loss, used


class Exact(Solver):
    """Optimal multiple-choice knapsack. Params: ``metric``, ``rules`` (comma list or list; None = all).

    Over every axis the profile measured (:attr:`~polykv.profiling.profile.Profile.axes`): its low-rank configs
    are more columns of the same knapsack; with a pair table, :func:`polykv.solvers.chain.solve_chain` also
    weighs sharing each measured pair."""

    name = "exact"
    defaults = {"metric": None, "rules": None}
    param_specs = {"metric": METRIC_SPEC}
    rule_lists = ("rules",)
    routes_axes = True
    paper = "MoE-nD additive model, arXiv 2604.17695; exact multiple-choice knapsack"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        table = profile.table(p["metric"])
        cols = candidate_columns(self, profile, p["rules"])
        axes = profile.axes
        check_axes_metric(self, profile, p["metric"])
        note = "optimal under the additive loss model" + (f"; routed axes: {', '.join(axes)}" if len(axes) > 2
                                                           else "")
        layers, loss, used, shared = solve_columns(self, profile, budget, table, cols, p["metric"])
        return self.plan(profile, budget, layers, p, predicted_loss=loss, predicted_bits=used,
                         note=note if shared is None else f"{note}; shared pairs: {shared}")


def check_axes_metric(solver: Solver, profile: Profile, metric: str | None) -> None:
    """Refuse a metric in which the profile did not price its shared pairs (a profile calibrated without held-out
    sequences measured them in ``l2`` only; with them, ``pair_<metric>`` holds each objective's)."""
    name = metric or profile.default_metric
    parts = list(profile.objective_weights or {}) if name == MIX_METRIC else [name]
    if name != "l2" and any(c.low_rank for c in profile.configs) and any(f"rank_{m}" not in profile.stats
                                                                        for m in parts):
        raise SolverError(f"solver '{solver.name}': {profile.source} measured its low-rank configs in metric 'l2' only, "
                          f"not '{name}'; route on l2 (--metric l2), or calibrate --ranks with held-out sequences "
                          "(--validate N) to price them end to end")
    if profile.pairs is not None and pair_losses(profile, name) is None:
        raise SolverError(f"solver '{solver.name}': {profile.source} measured its layer pairs in metric 'l2' only, not "
                          f"'{name}'; route on l2 (--metric l2), or calibrate --pairs with held-out sequences "
                          "(--validate N) to price them end to end")


def solve_columns(solver: Solver, profile: Profile, budget: Budget, table: np.ndarray, cols: np.ndarray,
                  metric: str | None = None) -> tuple[list[dict], float, int, str | None]:
    """The optimal plan over ``cols`` (and the profile's shared pairs, when it has a pair table, priced in ``metric``,
    the table's): (layer entries, loss, bits, the shared pairs as text or None without a pair table). Fails with the
    minimum budget."""
    if profile.pairs is None:
        chosen, loss, used = optimal_columns(solver, profile, budget, table, cols, "the lightest config per layer")
        return ([solver.layer_entry(profile.configs[c], f"layer {i}", profile=profile) for i, c in enumerate(chosen)],
                loss, used, None)
    L, pairs = profile.num_layers, profile.pairs
    pair_loss = np.full(L, np.nan)
    pair_loss[list(pairs.uppers)] = pair_losses(profile, metric or profile.default_metric)
    pair_weight = np.full(L, budget.pair_bits(profile.model, pairs.share_params, solver.registry), np.int64)
    bits = config_bits(profile, budget, solver)
    try:
        choice, uppers, loss, used = solve_chain(table[:, cols], bits[cols], budget.to_bits(profile.model),
                                                 pair_loss, pair_weight)
    except Infeasible as exc:
        raise SolverError(min_bytes_message(solver.name, exc.need, budget, "the lightest config or shared pair "
                                            "per layer")) from None
    layers = []
    for i, c in enumerate(choice):
        if c == PAIRED:
            shared = {"share": i - 1, "share_params": dict(pairs.share_params)} if i in uppers else {}
            layers.append({"prefill": FULL_OP, "decode": FULL_OP, **shared})
        else:
            layers.append(solver.layer_entry(profile.configs[int(cols[c])], f"layer {i}", profile=profile))
    return layers, loss, used, ", ".join(f"{u - 1}-{u}" for u in uppers) or "none"
