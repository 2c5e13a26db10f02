"""Exact choice per layer with shared adjacent pairs: the multiple-choice knapsack over a chain of layers.

Problem: cover the layers 0..L-1 by *items*: a single layer l running one of its choices c (loss S[l, c],
integer weight w[l, c]), or a shared pair (l - 1, l) (loss P[l], weight Q[l]: both layers keep every token
at 16 bits and store the pair once, so its cost and error belong to the two layers together). Minimise the
summed loss within the capacity W. Without pairs this is :func:`polykv.solvers.mckp.solve_mckp`'s problem.

Method (exact): dynamic programming over Pareto frontiers along the chain. F[k] holds every non-dominated
(weight, loss) of the partial solutions that cover exactly the layers 0..k-1; F[k] comes from F[k-1]
extended by a choice of layer k-1 and from F[k-2] extended by the pair (k-2, k-1). How a prefix was covered
does not constrain the layers after it, so a dominated partial solution (another is no heavier and no worse)
extends to nothing the dominating one cannot match: dropping it is safe, and the best entry of F[L] is
optimal. Two prunings keep the frontiers small, both safe:

* feasibility: a partial solution whose weight plus the lightest cover of the remaining layers exceeds W;
* a bound: the partial loss plus a lower bound of the remaining layers' loss at the remaining capacity,
  above the loss U of a known feasible plan (the optimum without pairs, when one exists). The lower bound
  is the linear relaxation of a *relaxed* problem where each layer may also take half of any pair it belongs
  to (half the loss, the weight rounded down) on its own: every cover by items is feasible there, so its
  relaxation (:mod:`polykv.solvers.mckp`'s hull greedy) never exceeds the true optimum.

Weights are exact integers; losses are float64 sums, and pruning keeps a relative slack of 1e-9.
"""

from __future__ import annotations

import numpy as np

from polykv.errors import SolverError
from polykv.solvers.mckp import Infeasible, efficient_items, hull_segments, suffix_relaxations, solve_mckp

PAIRED = -1
"""The choice reported for a layer of a shared pair."""


def solve_chain(loss: np.ndarray, weight: np.ndarray, capacity: int, pair_loss: np.ndarray,
                pair_weight: np.ndarray) -> tuple[np.ndarray, list[int], float, int]:
    """Optimal cover of the layer chain (module docstring).

    Parameters
    ----------
    loss : [L, C] float
        Loss of choice c on layer l.
    weight : [L, C] or [C] int
        Integer weight of choice c on layer l.
    capacity : int
        Budget on the summed weight.
    pair_loss : [L] float
        ``pair_loss[l]``: loss of sharing the pair (l - 1, l); NaN where that pair may not be shared (always at 0).
    pair_weight : [L] int
        ``pair_weight[l]``: weight of that pair (both layers together).

    Returns
    -------
    (choice [L] int64 with :data:`PAIRED` on shared layers, the upper layers of the shared pairs, total loss,
    total weight). Raises :class:`~polykv.solvers.mckp.Infeasible` when nothing fits.
    """
    loss = np.asarray(loss, dtype=np.float64)
    L, C = loss.shape
    weight = np.broadcast_to(np.asarray(weight, dtype=np.int64), (L, C))
    p_loss = np.asarray(pair_loss, dtype=np.float64).reshape(L)
    p_w = np.asarray(pair_weight, dtype=np.int64).reshape(L)
    has_pair = np.isfinite(p_loss)
    has_pair[0] = False
    if (p_w[has_pair] < 0).any() or (weight < 0).any():
        raise SolverError("weights must be non-negative integers")
    eff = [efficient_items(weight[layer], loss[layer]) for layer in range(L)]
    eff_w = [weight[layer, e] for layer, e in enumerate(eff)]
    eff_s = [loss[layer, e] for layer, e in enumerate(eff)]

    # lightest cover of the layers k..L-1
    rest_w = np.zeros(L + 2, dtype=object)
    for k in range(L - 1, -1, -1):
        best = int(eff_w[k][0]) + rest_w[k + 1]
        if k + 1 < L and has_pair[k + 1]:
            best = min(best, int(p_w[k + 1]) + rest_w[k + 2])
        rest_w[k] = best
    if rest_w[0] > capacity:
        raise Infeasible(rest_w[0], capacity)

    upper = np.inf
    try:
        upper = solve_mckp(loss, weight, capacity)[1]
    except Infeasible:
        pass
    lp = suffix_relaxations(*_relaxed_items(eff_w, eff_s, p_loss, p_w, has_pair))
    slack = 1e-9 * (1.0 + abs(upper)) if np.isfinite(upper) else np.inf

    # frontiers[k]: (weights, losses, source step 1 or 2, parent index, pick)
    frontiers = [(np.zeros(1, np.int64), np.zeros(1, np.float64), None, None, None)]
    for k in range(1, L + 1):
        parts_w, parts_s, parts_src, parts_par, parts_pick = [], [], [], [], []
        fw, fs = frontiers[k - 1][:2]
        n = len(eff_w[k - 1])
        parts_w.append((fw[:, None] + eff_w[k - 1][None, :]).ravel())
        parts_s.append((fs[:, None] + eff_s[k - 1][None, :]).ravel())
        idx = np.arange(len(fw) * n)
        parts_src.append(np.ones(len(idx), np.int64))
        parts_par.append(idx // n)
        parts_pick.append(eff[k - 1][idx % n])
        if k >= 2 and has_pair[k - 1]:
            gw, gs = frontiers[k - 2][:2]
            parts_w.append(gw + p_w[k - 1])
            parts_s.append(gs + p_loss[k - 1])
            parts_src.append(np.full(len(gw), 2, np.int64))
            parts_par.append(np.arange(len(gw)))
            parts_pick.append(np.full(len(gw), PAIRED, np.int64))
        cw, cs = np.concatenate(parts_w), np.concatenate(parts_s)
        src, par, pick = np.concatenate(parts_src), np.concatenate(parts_par), np.concatenate(parts_pick)
        room = capacity - cw
        ok = room >= rest_w[k]
        xp, fp = lp[k]
        ok &= cs + np.interp(room.astype(np.float64), xp, fp) <= upper + slack
        keep = np.flatnonzero(ok)
        cw, cs, src, par, pick = cw[keep], cs[keep], src[keep], par[keep], pick[keep]
        order = np.lexsort((cs, cw))
        cw, cs, src, par, pick = cw[order], cs[order], src[order], par[order], pick[order]
        prev_min = np.minimum.accumulate(np.concatenate(([np.inf], cs[:-1])))
        front = cs < prev_min
        frontiers.append((cw[front], cs[front], src[front], par[front], pick[front]))
    fw, fs = frontiers[L][:2]
    if len(fw) == 0:  # cannot happen while rest_w[0] <= capacity; kept as a loud guard
        raise SolverError("the chain solver lost every feasible solution; report this as a bug")
    best = int(np.argmin(fs))
    total_loss, total_weight = float(fs[best]), int(fw[best])
    choice = np.full(L, PAIRED, np.int64)
    uppers = []
    k = L
    while k > 0:
        _, _, src, par, pick = frontiers[k]
        step, nxt = int(src[best]), int(par[best])
        if step == 1:
            choice[k - 1] = int(pick[best])
        else:
            uppers.append(k - 1)
        best, k = nxt, k - step
    return choice, sorted(uppers), total_loss, total_weight


def _relaxed_items(eff_w, eff_s, p_loss, p_w, has_pair):
    """Per layer the efficient points and hull segments of its choices plus half of each pair it belongs to."""
    L = len(eff_w)
    out_w, out_s = [], []
    for layer in range(L):
        w, s = [eff_w[layer]], [eff_s[layer]]
        for upper in (layer, layer + 1):
            if upper < L and has_pair[upper]:
                w.append(np.array([int(p_w[upper]) // 2], np.int64))
                s.append(np.array([p_loss[upper] / 2.0]))
        w, s = np.concatenate(w), np.concatenate(s)
        e = efficient_items(w, s)
        out_w.append(w[e])
        out_s.append(s[e])
    return out_w, out_s, [hull_segments(w, s) for w, s in zip(out_w, out_s)]
