"""Exact multiple-choice knapsack: one config per layer, minimum summed loss within a bit budget.

Problem: choose c_l for every layer l to minimise sum_l S[l, c_l] subject to
sum_l w[l, c_l] <= W, with integer weights w (nominal bits) and real losses S.

Method (exact): dynamic programming over Pareto frontiers with bound pruning.

1. Per layer, drop *dominated* choices (another is no heavier and has no higher loss): an optimal
   solution never needs them.
2. Process layers in order, keeping after layer k every non-dominated partial solution
   (weight, loss). Dropping a dominated partial solution is safe: the dominating one extends with
   the same choices to a solution no heavier and no worse.
3. Drop a partial solution that cannot be completed within W (its weight plus the lightest choice
   of every remaining layer exceeds W), or whose *lower bound* exceeds the loss U of a known
   feasible solution. The bound is the partial loss plus LP_{k+1}(W - weight), the optimum of the
   linear relaxation of the remaining layers, which is never above their integer optimum: it is
   the classic greedy over the lower convex hulls of the remaining layers (Sinha & Zoltners 1979),
   evaluated for all states at once by interpolation. U comes from rounding that relaxation down.
4. The best surviving complete solution is optimal: every optimal solution has a prefix that is
   either kept or dominated by a kept one, and the bound never removes a prefix that could beat U.

Weights are exact integers (no rounding, no scaling), so feasibility is decided exactly; losses are
float64 sums, and pruning keeps a relative slack of 1e-9 so rounding never removes the optimum.
"""

from __future__ import annotations

import numpy as np

from polykv.errors import SolverError


class Infeasible(SolverError):
    """Even the lightest choice on every layer exceeds the budget; ``need`` is that weight."""

    def __init__(self, need: int, capacity: int):
        self.need, self.capacity = int(need), int(capacity)
        super().__init__(f"the lightest choice per layer weighs {need}, over the capacity {capacity}")


def efficient_items(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated points, by increasing weight (so strictly decreasing loss)."""
    order = np.lexsort((s, w))
    ws, ss = w[order], s[order]
    prev_min = np.minimum.accumulate(np.concatenate(([np.inf], ss[:-1])))
    return order[ss < prev_min]


def hull_segments(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments (dw, ds) of the lower convex hull of efficient points (w ascending, s descending)."""
    hull = [0]
    for i in range(1, len(w)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the chord a -> i: drop it (cross product sign, exact for ints/floats used here)
            if (s[b] - s[a]) * (w[i] - w[a]) >= (s[i] - s[a]) * (w[b] - w[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    h = np.asarray(hull)
    return np.diff(w[h]).astype(np.float64), np.diff(s[h])


def solve_mckp(loss: np.ndarray, weight: np.ndarray, capacity: int,
               allowed: np.ndarray | None = None) -> tuple[np.ndarray, float, int]:
    """Optimal choice per layer.

    Parameters
    ----------
    loss : [L, C] float
        Loss of choice c on layer l (any real numbers).
    weight : [L, C] or [C] int
        Integer weight of choice c on layer l.
    capacity : int
        Budget on the summed weight.
    allowed : [L, C] bool, optional
        Choices that may be used (default: all).

    Returns
    -------
    (choice [L] int64, total loss, total weight). Raises :class:`Infeasible` when nothing fits.
    """
    loss = np.asarray(loss, dtype=np.float64)
    L, C = loss.shape
    weight = np.broadcast_to(np.asarray(weight, dtype=np.int64), (L, C))
    allowed = np.ones((L, C), bool) if allowed is None else np.asarray(allowed, bool)
    eff_idx, eff_w, eff_s = [], [], []
    for layer in range(L):
        cols = np.flatnonzero(allowed[layer])
        if cols.size == 0:
            raise SolverError(f"layer {layer} has no allowed choice")
        keep = cols[efficient_items(weight[layer, cols], loss[layer, cols])]
        eff_idx.append(keep)
        eff_w.append(weight[layer, keep])
        eff_s.append(loss[layer, keep])
    min_w = np.array([w[0] for w in eff_w], dtype=np.int64)
    rest_w = np.concatenate((np.cumsum(min_w[::-1])[::-1], [0]))  # rest_w[k] = lightest weight of layers k..
    if rest_w[0] > capacity:
        raise Infeasible(rest_w[0], capacity)
    segs = [hull_segments(w, s) for w, s in zip(eff_w, eff_s)]
    lp = suffix_relaxations(eff_w, eff_s, segs)
    upper, _ = _rounded_relaxation(eff_w, eff_s, segs, capacity)
    slack = 1e-9 * (1.0 + abs(upper))

    fw = np.zeros(1, np.int64)
    fs = np.zeros(1, np.float64)
    parents: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    for k in range(L):
        cw = (fw[:, None] + eff_w[k][None, :]).ravel()
        cs = (fs[:, None] + eff_s[k][None, :]).ravel()
        n = len(eff_w[k])
        room = capacity - cw
        ok = room >= rest_w[k + 1]
        xp, fp = lp[k + 1]
        ok &= cs + np.interp(room.astype(np.float64), xp, fp) <= upper + slack
        idx = np.flatnonzero(ok)
        cw, cs = cw[idx], cs[idx]
        order = np.lexsort((cs, cw))
        cw, cs, idx = cw[order], cs[order], idx[order]
        prev_min = np.minimum.accumulate(np.concatenate(([np.inf], cs[:-1])))
        front = cs < prev_min
        fw, fs, idx = cw[front], cs[front], idx[front]
        parents.append(idx // n)
        picks.append(eff_idx[k][idx % n])
    best = int(np.argmin(fs))
    total_loss, total_weight = float(fs[best]), int(fw[best])
    choice = np.empty(L, np.int64)
    for k in range(L - 1, -1, -1):
        choice[k] = picks[k][best]
        best = int(parents[k][best])
    return choice, total_loss, total_weight


def suffix_relaxations(eff_w, eff_s, segs) -> list[tuple[np.ndarray, np.ndarray]]:
    """For k = 0..L, breakpoints (remaining capacity, loss) of the LP relaxation of layers k..L-1.

    The relaxation of layers k.. takes their hull segments steepest first; sorting every segment
    once and keeping those of layers >= k gives each suffix's order without sorting again.
    """
    L = len(eff_w)
    layer_of = np.concatenate([np.full(len(segs[k][0]), k) for k in range(L)]).astype(np.int64)
    dw = np.concatenate([segs[k][0] for k in range(L)])
    ds = np.concatenate([segs[k][1] for k in range(L)])
    order = np.argsort(ds / dw, kind="stable") if len(dw) else np.zeros(0, np.int64)
    layer_of, dw, ds = layer_of[order], dw[order], ds[order]
    base_w = np.concatenate((np.cumsum([float(w[0]) for w in eff_w][::-1])[::-1], [0.0]))
    base_s = np.concatenate((np.cumsum([float(s[0]) for s in eff_s][::-1])[::-1], [0.0]))
    out = []
    for k in range(L + 1):
        sel = layer_of >= k
        xp = base_w[k] + np.concatenate(([0.0], np.cumsum(dw[sel])))
        fp = base_s[k] + np.concatenate(([0.0], np.cumsum(ds[sel])))
        out.append((xp, fp))
    return out


def _rounded_relaxation(eff_w, eff_s, segs, capacity: int) -> tuple[float, int]:
    """A feasible solution: the relaxation's greedy, taking only whole hull segments that fit."""
    L = len(eff_w)
    layer_of = np.concatenate([np.full(len(segs[k][0]), k) for k in range(L)]).astype(np.int64)
    dw = np.concatenate([segs[k][0] for k in range(L)])
    ds = np.concatenate([segs[k][1] for k in range(L)])
    total_w = int(sum(int(w[0]) for w in eff_w))
    total_s = float(sum(float(s[0]) for s in eff_s))
    blocked = np.zeros(L, bool)
    for j in np.argsort(ds / dw, kind="stable") if len(dw) else []:
        k = layer_of[j]
        if blocked[k]:
            continue
        if total_w + int(dw[j]) <= capacity:
            total_w += int(dw[j])
            total_s += float(ds[j])
        else:
            blocked[k] = True  # a layer's hull segments must be taken in order
    return total_s, total_w
