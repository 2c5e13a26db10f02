"""Paired statistics of studies, re-exported from :mod:`polykv.stats` (a bottom module, because
calibration's validation uses the same correlations)."""

from polykv.stats import (  # noqa: F401
    DEFAULT_REPLICATES,
    DEFAULT_PERMUTATIONS,
    Interval,
    Correlation,
    PlacementControl,
    wilson_interval,
    bootstrap_mean,
    paired_bootstrap,
    paired_bootstrap_tasks,
    rankdata,
    spearman,
    pearson,
    placement_control,
    random_placements,
    moend_ablation,
    FACTORIAL_CELLS,
    polykv_factorial,
)
