"""Paired statistics for studies and calibration: intervals, bootstraps and correlations.

Compression effects between policies are small (PolyKV reports +0.26 LongBench points for routing),
so a study never reports a bare difference: every comparison is paired over the same items (or the
same tasks) and comes with an interval. Everything here is plain numpy and seeded, so a report is
reproducible to the last digit.

- :func:`wilson_interval` — Wilson score interval for an accuracy (Wilson, 1927; Newcombe, 1998).
- :func:`paired_bootstrap` — percentile bootstrap CI of mean(a - b) over the same items
  (Efron & Tibshirani, 1993), 10,000 seeded replicates by default.
- :func:`paired_bootstrap_tasks` — the same, resampling tasks (each task's mean is one unit).
- :func:`spearman`, :func:`pearson` — correlations with a seeded permutation p-value.

The summaries of particular study designs (placement control, MoE-nD's ablation chain, PolyKV's
factorial) build on these in :mod:`polykv.studies.stats`.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Mapping

import attrs
import numpy as np

from polykv.errors import StudyError

DEFAULT_REPLICATES = 10_000
DEFAULT_PERMUTATIONS = 10_000
_CHUNK = 1024  # bootstrap replicates drawn per block, to bound memory for long item lists


@attrs.define(frozen=True, kw_only=True)
class Interval:
    """A point estimate with a two-sided interval."""

    estimate: float
    """The point estimate (an accuracy, or a mean difference)."""
    low: float
    """Lower end of the interval."""
    high: float
    """Upper end of the interval."""
    level: float
    """Coverage of the interval, e.g. 0.95."""
    n: int
    """Number of resampled units (items, tasks, trials)."""
    method: str
    """How the interval was computed ("wilson", "paired-bootstrap-percentile", ...)."""
    p_value: float | None = None
    """Two-sided bootstrap p-value for "no difference" (None where it does not apply)."""
    replicates: int | None = None
    """Bootstrap replicates (None for closed-form intervals)."""
    seed: int | None = None
    """Seed of the bootstrap generator (None for closed-form intervals)."""

    def excludes_zero(self) -> bool:
        """True when the interval lies entirely above or entirely below zero."""
        return self.low > 0.0 or self.high < 0.0

    def shows_difference(self) -> bool:
        """True when the interval excludes zero *and* rests on enough units to say so at its level
        (:func:`min_units_for_difference`). A bootstrap over one item gives the degenerate interval
        ``[d, d]``, which excludes zero whenever ``d != 0`` and says nothing."""
        return self.excludes_zero() and self.n >= min_units_for_difference(self.level)

    def difference_verdict(self, against: str) -> str:
        """``"no difference from AGAINST at 95%"``, ``"differs from AGAINST at 95%"``, or, where the interval
        cannot support a claim, how many units it would need."""
        level = f"{self.level:.0%}"
        if self.excludes_zero() and not self.shows_difference():
            return (f"too few items to tell at {level}: {self.n} item(s), a difference needs at least "
                    f"{min_units_for_difference(self.level)} that disagree")
        return f"{'differs from' if self.excludes_zero() else 'no difference from'} {against} at {level}"


def min_units_for_difference(level: float = 0.95) -> int:
    """Fewest paired units that can show a difference at ``level``: the exact two-sided sign test over
    ``n`` units that all disagree in one direction has p = 2 * 0.5**n, so ``n`` must reach
    ``log2(2 / (1 - level))`` (6 at 95%, 8 at 99%). Fewer items cannot exclude chance, whatever a
    bootstrap interval says."""
    if not 0.0 < level < 1.0:
        raise StudyError(f"interval level {level!r}: use a number between 0 and 1 (e.g. 0.95)")
    return max(1, math.ceil(math.log2(2.0 / (1.0 - level)) - 1e-12))


@attrs.define(frozen=True, kw_only=True)
class Correlation:
    """A correlation coefficient with its permutation p-value."""

    r: float
    """Pearson r or Spearman rho."""
    p_value: float
    """Permutation p-value: (1 + #shuffles at least as extreme) / (permutations + 1)."""
    n: int
    """Number of paired observations."""
    method: str
    """"spearman" or "pearson"."""
    alternative: str
    """"two-sided", "greater" or "less"."""
    permutations: int
    """Number of shuffles."""
    seed: int
    """Seed of the shuffle generator."""


def _level_z(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise StudyError(f"confidence level must lie in (0, 1); got {level}")
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def as_scores(x, name: str) -> np.ndarray:
    """``x`` as a float64 vector of per-item scores; a StudyError (naming ``name``) when it is not a
    non-empty 1-D sequence of finite numbers."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise StudyError(f"{name} must be a non-empty 1-D sequence of numbers; got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise StudyError(f"{name} contains NaN or infinite values; drop or fix those items first")
    return arr


def _paired(a, b, names=("a", "b")) -> tuple[np.ndarray, np.ndarray]:
    a, b = as_scores(a, names[0]), as_scores(b, names[1])
    if a.shape != b.shape:
        raise StudyError(f"paired scores must cover the same items: {names[0]} has {a.size} values, "
                         f"{names[1]} has {b.size}")
    return a, b


# -- accuracy -------------------------------------------------------------------------------------
def wilson_interval(successes: int, n: int, level: float = 0.95) -> Interval:
    """Wilson score interval for a binomial proportion ``successes / n``.

    Parameters
    ----------
    successes, n : int
        Correct items and items scored (0 <= successes <= n, n >= 1).
    level : float
        Two-sided coverage.

    Returns
    -------
    Interval
        ``estimate`` = successes / n; ``low``/``high`` from
        (p + z^2/2n -/+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n).
    """
    if n < 1 or not 0 <= successes <= n:
        raise StudyError(f"Wilson interval needs 0 <= successes <= n and n >= 1; got {successes}/{n}")
    z = _level_z(level)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    return Interval(estimate=p, low=low, high=high, level=level, n=n, method="wilson")


# -- bootstrap ------------------------------------------------------------------------------------
def bootstrap_mean(values, *, replicates: int = DEFAULT_REPLICATES, level: float = 0.95, seed: int = 0,
                   method: str = "bootstrap-percentile") -> Interval:
    """Percentile bootstrap interval of the mean of ``values`` (one number per unit), seeded.

    The p-value is two-sided: 2 * min(P*(mean <= 0), P*(mean >= 0)), capped at 1, where P* is the
    bootstrap distribution (a common, approximate test; report the interval first).
    """
    x = as_scores(values, "values")
    _level_z(level)
    if replicates < 1:
        raise StudyError(f"bootstrap needs at least one replicate; got {replicates}")
    rng = np.random.default_rng(seed)
    n = x.size
    means = np.empty(replicates, dtype=np.float64)
    for start in range(0, replicates, _CHUNK):
        stop = min(replicates, start + _CHUNK)
        idx = rng.integers(0, n, size=(stop - start, n))  # (R_chunk, n) resampled unit indices
        means[start:stop] = x[idx].mean(axis=1)
    alpha = 1.0 - level
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    p = min(1.0, 2.0 * min(np.mean(means <= 0.0), np.mean(means >= 0.0)))
    return Interval(estimate=float(x.mean()), low=float(low), high=float(high), level=level, n=n,
                    method=method, p_value=float(p), replicates=replicates, seed=seed)


def paired_bootstrap(a, b, *, replicates: int = DEFAULT_REPLICATES, level: float = 0.95,
                     seed: int = 0) -> Interval:
    """Paired bootstrap CI for mean(a) - mean(b) over the same items.

    Parameters
    ----------
    a, b : sequence of float, shape [n]
        Per-item scores of two policies on the *same* items, in the same order.
    """
    a, b = _paired(a, b)
    return bootstrap_mean(a - b, replicates=replicates, level=level, seed=seed,
                          method="paired-bootstrap-percentile")


def _task_means(scores: Mapping[str, object], name: str) -> dict[str, float]:
    out = {}
    for task, value in scores.items():
        arr = as_scores(np.atleast_1d(value), f"{name}[{task!r}]")
        out[task] = float(arr.mean())
    return out


def paired_bootstrap_tasks(a: Mapping[str, object], b: Mapping[str, object], *,
                           replicates: int = DEFAULT_REPLICATES, level: float = 0.95, seed: int = 0) -> Interval:
    """Paired bootstrap over tasks: resample tasks, not items (PolyKV's across-task comparison).

    Parameters
    ----------
    a, b : mapping task name -> score or per-item scores
        Each task's value is reduced to its mean; both mappings must name the same tasks.

    Returns
    -------
    Interval
        Estimate = mean over tasks of (task mean of a - task mean of b); the interval resamples tasks.
    """
    ma, mb = _task_means(a, "a"), _task_means(b, "b")
    if set(ma) != set(mb):
        raise StudyError(f"paired task bootstrap needs the same tasks on both sides; only in a: "
                         f"{sorted(set(ma) - set(mb))}, only in b: {sorted(set(mb) - set(ma))}")
    tasks = sorted(ma)
    diffs = np.array([ma[t] - mb[t] for t in tasks])
    return bootstrap_mean(diffs, replicates=replicates, level=level, seed=seed,
                          method="paired-task-bootstrap-percentile")


# -- correlation ----------------------------------------------------------------------------------
def rankdata(x) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (as Spearman's rho requires)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size, dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < x.size:
        j = i
        while j + 1 < x.size and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def _pearson_r(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of x [n] against each row of y [..., n]."""
    xc = x - x.mean()
    yc = y - y.mean(axis=-1, keepdims=True)
    return (yc @ xc) / np.sqrt((xc @ xc) * np.sum(yc * yc, axis=-1))


def _correlate(x, y, *, method: str, permutations: int, seed: int, alternative: str) -> Correlation:
    x, y = _paired(x, y, ("x", "y"))
    if x.size < 3:
        raise StudyError(f"a correlation needs at least 3 paired observations; got {x.size}")
    if permutations < 1:
        raise StudyError(f"a permutation test needs at least one shuffle; got {permutations}")
    if alternative not in ("two-sided", "greater", "less"):
        raise StudyError(f"alternative must be 'two-sided', 'greater' or 'less'; got {alternative!r}")
    if method == "spearman":
        x, y = rankdata(x), rankdata(y)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        raise StudyError(f"{method} correlation is undefined when one side is constant")
    r = float(_pearson_r(x, y[None, :])[0])
    rng = np.random.default_rng(seed)
    null = np.empty(permutations, dtype=np.float64)
    for start in range(0, permutations, _CHUNK):
        stop = min(permutations, start + _CHUNK)
        shuffled = rng.permuted(np.broadcast_to(y, (stop - start, y.size)), axis=1)
        null[start:stop] = _pearson_r(x, shuffled)
    eps = 1e-12  # shuffles equal to r up to rounding count as "at least as extreme"
    if alternative == "two-sided":
        extreme = np.sum(np.abs(null) >= abs(r) - eps)
    elif alternative == "greater":
        extreme = np.sum(null >= r - eps)
    else:
        extreme = np.sum(null <= r + eps)
    p = (1.0 + extreme) / (permutations + 1.0)
    return Correlation(r=r, p_value=float(p), n=int(x.size), method=method, alternative=alternative,
                       permutations=permutations, seed=seed)


def spearman(x, y, *, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0,
             alternative: str = "two-sided") -> Correlation:
    """Spearman's rho (Pearson r of average ranks) with a seeded permutation p-value.

    PolyKV's profile validation: x = profile scores S(rho) of candidate routes, y = downstream scores.
    """
    return _correlate(x, y, method="spearman", permutations=permutations, seed=seed, alternative=alternative)


def pearson(x, y, *, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0,
            alternative: str = "two-sided") -> Correlation:
    """Pearson's r with a seeded permutation p-value (MoE-nD validates sensitivity against KL this way)."""
    return _correlate(x, y, method="pearson", permutations=permutations, seed=seed, alternative=alternative)
