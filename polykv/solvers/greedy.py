"""``moend-greedy``: MoE-nD's reference greedy over (keep ratio, K bits, V bits) per layer.

MoE-nD (arXiv 2604.17695), Sec. "Solver": every layer starts at its cheapest config (lowest keep,
lowest K width, lowest V width: keep 0.1 / K4 / V4 on the paper's grid). Each step considers, for
every layer, the three single-axis one-step upgrades (next keep ratio, next K width, next V width),
skips those that do not reduce the layer's loss S or would exceed the budget M, and applies the
one with the largest dS/dm; it stops when none is left. If the cheapest plan already exceeds M it
fails and names the minimum feasible budget. Ties go to the lowest layer, then keep, K, V.
An upgrade that adds no bytes (dm = 0, possible when rounding to whole tokens) ranks first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polykv.errors import SolverError
from polykv.plan import FULL_RULE
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile
from polykv.solvers.base import METRIC_SPEC, RULE_SPEC, Solver, config_bits, min_bytes_message
from polykv.solvers.mckp import Infeasible


def rule_grid(profile: Profile, rule: str | None, solver: str) -> tuple[str, np.ndarray, list[tuple]]:
    """The (keep, K, V) grid of one rule: ``grid[i, j, k]`` = column index; keep-1.0 'full' configs fill in.

    Returns (rule, grid [n_keep, n_k, n_v] int64, axes as (keeps, k_bits, v_bits)).
    """
    rules = sorted({c.rule for c in profile.configs if c.rule != FULL_RULE})
    if rule is None:
        if len(rules) != 1:
            raise SolverError(f"solver '{solver}': the profile has rules {rules}; choose one with --param rule=NAME")
        rule = rules[0]
    elif rule not in rules:
        raise SolverError(f"solver '{solver}': the profile has no configs of rule '{rule}'; it has {rules}")
    cells: dict[tuple, int] = {}
    for i, c in enumerate(profile.configs):
        if c.rule == rule or (c.rule == FULL_RULE and c.keeps_everything):
            key = (float(c.keep), c.k_bits, c.v_bits)
            if key in cells and profile.configs[cells[key]].rule == rule and c.rule == rule:
                raise SolverError(f"solver '{solver}': configs[{cells[key]}] and configs[{i}] are both "
                                  f"keep={key[0]:g} K{key[1]} V{key[2]} for rule '{rule}'; the grid needs one each")
            if key not in cells or c.rule == rule:
                cells[key] = i
    axes = tuple(sorted({k[a] for k in cells}) for a in range(3))
    grid = np.empty([len(a) for a in axes], np.int64)
    for ia, keep in enumerate(axes[0]):
        for ib, kb in enumerate(axes[1]):
            for ic, vb in enumerate(axes[2]):
                if (keep, kb, vb) not in cells:
                    raise SolverError(f"solver '{solver}': rule '{rule}' has no config keep={keep:g} K{kb} V{vb}; "
                                      "the greedy walks a full keep x K x V grid, so the profile must list every "
                                      "combination")
                grid[ia, ib, ic] = cells[(keep, kb, vb)]
    return rule, grid, list(axes)


def moend_greedy(S: np.ndarray, m: np.ndarray, capacity: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The reference greedy on a grid.

    Parameters
    ----------
    S : [L, n_keep, n_k, n_v] float
        Loss of each grid cell on each layer.
    m : [n_keep, n_k, n_v] int
        Nominal bits of each cell (the same on every layer).
    capacity : int
        Budget in bits.

    Returns
    -------
    (position [L, 3] grid coordinates chosen, steps [(layer, axis), ...] in the order applied).
    Raises :class:`~polykv.solvers.mckp.Infeasible` (with ``need``) when the cheapest plan exceeds ``capacity``.
    """
    L = S.shape[0]
    dims = np.array(m.shape)
    pos = np.zeros((L, 3), np.int64)
    used = int(L * m[0, 0, 0])
    if used > capacity:
        raise Infeasible(used, capacity)
    gain = np.zeros((L, 3))
    cost = np.zeros((L, 3), np.int64)
    valid = np.zeros((L, 3), bool)

    def refresh(layer: int) -> None:
        p = tuple(pos[layer])
        for axis in range(3):
            q = list(p)
            q[axis] += 1
            if q[axis] >= dims[axis]:
                valid[layer, axis] = False
                continue
            q = tuple(q)
            gain[layer, axis] = S[(layer,) + p] - S[(layer,) + q]
            cost[layer, axis] = m[q] - m[p]
            valid[layer, axis] = gain[layer, axis] > 0

    for layer in range(L):
        refresh(layer)
    steps = []
    while True:
        ok = valid & (cost <= capacity - used)
        if not ok.any():
            break
        with np.errstate(divide="ignore"):
            ratio = np.where(cost > 0, gain / np.maximum(cost, 1), np.inf)
        ratio = np.where(ok, ratio, -np.inf)
        layer, axis = divmod(int(np.argmax(ratio)), 3)
        used += int(cost[layer, axis])
        pos[layer, axis] += 1
        steps.append((layer, axis))
        refresh(layer)
    return pos, steps


class MoendGreedy(Solver):
    """MoE-nD's greedy (see the module docstring). Params: ``rule`` (when the profile has several), ``metric``."""

    name = "moend-greedy"
    defaults = {"rule": None, "metric": None}
    param_specs = {"rule": RULE_SPEC, "metric": METRIC_SPEC}
    paper = "MoE-nD, arXiv 2604.17695"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        table = profile.table(p["metric"])
        rule, grid, axes = rule_grid(profile, p["rule"], self.name)
        self.check_configs(profile, grid.ravel())
        bits = config_bits(profile, budget, self)
        capacity = budget.to_bits(profile.model)
        try:
            pos, steps = moend_greedy(table[:, grid], bits[grid], capacity)
        except Infeasible as exc:
            c = profile.configs[grid[0, 0, 0]]
            raise SolverError(min_bytes_message(self.name, exc.need, budget, f"keep {c.keep:g}, K{c.k_bits}, "
                                                f"V{c.v_bits} on every layer")) from None
        cols = [int(grid[tuple(x)]) for x in pos]
        layers = [self.layer_entry(profile.configs[c], f"layer {i}", profile=profile) for i, c in enumerate(cols)]
        loss = float(sum(table[i, c] for i, c in enumerate(cols)))
        return self.plan(profile, budget, layers, {**p, "rule": rule}, predicted_loss=loss,
                         predicted_bits=int(bits[cols].sum()), note=f"{len(steps)} greedy upgrades")
