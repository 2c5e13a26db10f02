"""Summaries of a calibrated profile: MoE-nD's Table 1 (spread of per-layer sensitivity per operation)
and the L2-vs-KL validation, as Markdown for ``docs/calibration.md``.

>>> print(operation_table_markdown(load_profile("profiles/smollm2-135m-instruct.profile.json")))  # doctest: +SKIP

Run ``python -m polykv.profiling.calib_report PROFILE`` to print both tables.
"""

from __future__ import annotations

import sys

import numpy as np

from polykv.profiling.profile import Profile, load_profile
from polykv.profiling.profile_checks import FULL_RULE


def operation_rows(profile: Profile, metric: str = "l2") -> list[tuple[str, float, float, float]]:
    """(operation, min over layers, max over layers, max/min) for each single operation.

    Operations, each alone with everything else untouched: every rule at every keep < 1 (16-bit K
    and V), K at each width below 16 (keep 1.0, V 16), V at each width below 16 (keep 1.0, K 16).
    """
    table = profile.table(metric)
    rows = []

    def add(name, col):
        v = table[:, col]
        lo, hi = float(v.min()), float(v.max())
        rows.append((name, lo, hi, hi / lo if lo > 0 else float("inf")))

    for i, c in enumerate(profile.configs):
        if c.rule != FULL_RULE and c.k_bits == 16 and c.v_bits == 16:
            add(f"{c.rule} keep {c.keep:g}", i)
    for axis, other, label in (("k_bits", "v_bits", "K"), ("v_bits", "k_bits", "V")):
        for i, c in enumerate(profile.configs):
            if c.keeps_everything and getattr(c, axis) < 16 and getattr(c, other) == 16:
                add(f"{label} {getattr(c, axis)} bits", i)
    return rows


def operation_table_markdown(profile: Profile, metric: str = "l2") -> str:
    lines = [f"| operation | min {metric} | max {metric} | max/min |", "|---|---:|---:|---:|"]
    for name, lo, hi, ratio in operation_rows(profile, metric):
        lines.append(f"| {name} | {lo:.4g} | {hi:.4g} | {ratio:.3g} |")
    return "\n".join(lines)


def validation_markdown(profile: Profile) -> str:
    """Per-layer Pearson / Spearman between ``l2`` and the sampled KL, and their means."""
    if "l2_kl_correlation" not in profile.stats:
        return "(this profile has no KL validation; calibrate with --validate N)"
    corr = profile.stats["l2_kl_correlation"].values
    lines = ["| layer | Pearson | Spearman |", "|---:|---:|---:|"]
    lines += [f"| {i} | {p:.3f} | {s:.3f} |" for i, (p, s) in enumerate(corr)]
    m = np.mean(corr, axis=0)
    lines.append(f"| **mean** | **{m[0]:.3f}** | **{m[1]:.3f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m polykv.profiling.calib_report PROFILE", file=sys.stderr)
        return 2
    prof = load_profile(args[0])
    print(operation_table_markdown(prof))
    print()
    print(validation_markdown(prof))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
