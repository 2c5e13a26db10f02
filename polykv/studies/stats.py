"""Statistics of studies: the summaries of particular study designs, built on the paired statistics of
:mod:`polykv.profiling.stats` (intervals, bootstraps, correlations; in profiling because calibration's validation
uses the same correlations):

- :func:`placement_control` — PolyKV's count-matched placement control: the guided route's rank among
  N random placements and the one-sided Monte Carlo p = (1 + #random >= guided) / (N + 1).
- :func:`random_placements` — the count-matched random placements themselves.
- :func:`moend_ablation` — MoE-nD's chain d_quant = 2d - 2d_uniform, d_evict = 2d_hetero - 2d.
- :func:`polykv_factorial` — PolyKV's 2 x 2 (homogeneous | routed) x (uniform | allocated) summary.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs
import numpy as np

from polykv.solvers import placements
from polykv.errors import StudyError
from polykv.profiling.stats import DEFAULT_REPLICATES, Interval, as_scores, bootstrap_mean, paired_bootstrap


@attrs.define(frozen=True, kw_only=True)
class PlacementControl:
    """The guided route against count-matched random placements (PolyKV's placement control)."""

    guided: float
    """Downstream score of the guided route."""
    rank: int
    """1 + number of random placements scoring at least as well (ties count against the guided route)."""
    total: int
    """Number of random placements + 1 (the guided route)."""
    p_value: float
    """One-sided Monte Carlo p = (1 + #random >= guided) / (N + 1) = rank / total."""
    random_mean: float
    """Mean score of the random placements."""


# -- placement control ----------------------------------------------------------------------------
def placement_control(guided: float, random_scores: Sequence[float], *,
                      higher_is_better: bool = True) -> PlacementControl:
    """Rank of the guided route among count-matched random placements, and its Monte Carlo p.

    Parameters
    ----------
    guided : float
        Downstream score of the profile-guided route.
    random_scores : sequence of float, shape [N]
        Scores of N random placements with the same per-method layer counts.
    higher_is_better : bool
        Set False for losses (perplexity, KL).
    """
    r = as_scores(random_scores, "random_scores")
    g = float(guided)
    at_least = int(np.sum(r >= g)) if higher_is_better else int(np.sum(r <= g))
    return PlacementControl(guided=g, rank=1 + at_least, total=r.size + 1,
                            p_value=(1.0 + at_least) / (r.size + 1.0), random_mean=float(r.mean()))


def random_placements(counts: Mapping[str, int], n: int, *, seed: int = 0,
                      exclude: Sequence[Sequence[str]] = ()) -> list[tuple[str, ...]]:
    """``n`` unique random layer -> method placements with fixed method counts (seeded), drawn by
    :func:`polykv.solvers.placements.random_placements`.

    Parameters
    ----------
    counts : mapping method -> number of layers
        E.g. ``{"snapkv": 20, "tova": 10}`` for a 30-layer route; the layers total sum(counts).
    n : int
        Placements to draw (PolyKV uses 99).
    exclude : sequence of placements
        Placements never returned (pass the guided route).
    """
    route = [m for m in sorted(counts) for _ in range(int(counts[m]))]
    if not route:
        raise StudyError("random placements need at least one layer in counts")
    try:
        return placements.random_placements(route, n, seed, exclude=exclude)
    except ValueError as exc:
        raise StudyError(f"random placements for counts {dict(counts)}: {exc}") from None


# -- study summaries ------------------------------------------------------------------------------
def moend_ablation(scores: Mapping[str, object], *, replicates: int = DEFAULT_REPLICATES, level: float = 0.95,
                   seed: int = 0) -> dict[str, Interval]:
    """MoE-nD's ablation chain with paired intervals over the same items.

    Parameters
    ----------
    scores : mapping method -> per-item scores, shape [n]
        Must hold "2d_uniform", "2d" and "2d_hetero" (MoE-nD's baselines); "full" and "1d" are optional.

    Returns
    -------
    dict
        ``d_quant`` = 2d - 2d_uniform (per-layer bit routing), ``d_evict`` = 2d_hetero - 2d (per-layer
        eviction ratios), plus ``d_total`` = 2d_hetero - 2d_uniform, and ``hetero_vs_1d`` /
        ``hetero_vs_full`` when those are present.
    """
    need = ("2d_uniform", "2d", "2d_hetero")
    missing = [k for k in need if k not in scores]
    if missing:
        raise StudyError(f"MoE-nD ablation needs per-item scores for {list(need)}; missing {missing}")
    pairs = {"d_quant": ("2d", "2d_uniform"), "d_evict": ("2d_hetero", "2d"),
             "d_total": ("2d_hetero", "2d_uniform"), "hetero_vs_1d": ("2d_hetero", "1d"),
             "hetero_vs_full": ("2d_hetero", "full")}
    out = {}
    for name, (hi, lo) in pairs.items():
        if hi in scores and lo in scores:
            out[name] = paired_bootstrap(scores[hi], scores[lo], replicates=replicates, level=level, seed=seed)
    return out


FACTORIAL_CELLS = ("homogeneous_uniform", "homogeneous_allocated", "routed_uniform", "routed_allocated")


def polykv_factorial(scores: Mapping[str, object], *, replicates: int = DEFAULT_REPLICATES,
                     level: float = 0.95, seed: int = 0) -> dict[str, Interval]:
    """PolyKV's 2 x 2 factorial: (homogeneous | routed) x (uniform | allocated capacity).

    Parameters
    ----------
    scores : mapping cell -> per-item scores, shape [n]
        Cells: "homogeneous_uniform" (one rule, equal capacity), "homogeneous_allocated" (allocation
        only), "routed_uniform" (route only), "routed_allocated" (joint), all over the same items.

    Returns
    -------
    dict
        Per-cell mean accuracy intervals (``mean:<cell>``, bootstrap), the simple effects
        ``route_only`` / ``allocation_only`` / ``joint`` against homogeneous-uniform, the main effects
        ``routing`` = mean over capacity levels of (routed - homogeneous) and ``allocation`` likewise,
        and ``interaction`` = (joint - route_only) - (allocation_only - homogeneous); each a paired
        bootstrap interval of that per-item contrast.
    """
    missing = [c for c in FACTORIAL_CELLS if c not in scores]
    if missing:
        raise StudyError(f"PolyKV factorial needs per-item scores for {list(FACTORIAL_CELLS)}; missing {missing}")
    hu, ha, ru, ra = (as_scores(scores[c], c) for c in FACTORIAL_CELLS)
    if not hu.shape == ha.shape == ru.shape == ra.shape:
        raise StudyError("PolyKV factorial cells must cover the same items: got sizes "
                         + ", ".join(f"{c}={np.size(scores[c])}" for c in FACTORIAL_CELLS))
    contrasts = {
        "route_only": ru - hu,
        "allocation_only": ha - hu,
        "joint": ra - hu,
        "routing": 0.5 * ((ru - hu) + (ra - ha)),
        "allocation": 0.5 * ((ha - hu) + (ra - ru)),
        "interaction": (ra - ru) - (ha - hu),
    }
    kw = dict(replicates=replicates, level=level, seed=seed)
    out = {f"mean:{c}": bootstrap_mean(v, **kw) for c, v in zip(FACTORIAL_CELLS, (hu, ha, ru, ra))}
    for name, diff in contrasts.items():
        out[name] = bootstrap_mean(diff, method="paired-bootstrap-percentile", **kw)
    return out
