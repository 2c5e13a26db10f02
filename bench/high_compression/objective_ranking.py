"""How well each metric table of a profile (and a few objective mixes) ranks the high-compression study's plans.

For every distinct plan of the high-compression study at 8x and 12x that the profile can price (the additive loss
of :func:`polykv.studies.predicted.profile_loss`: the solved policies re-solved from the study's profile as the study
solves them, the plan files of ``plans/``), the Spearman of its predicted loss against the accuracy measured in
docs/results.md (passkey, niah, variable tracking; 20 items each), with the one sign convention of
:data:`polykv.studies.predicted.SPEARMAN_CONVENTION` (negative = the prediction ranks the plans right) and its
one-sided permutation p. ``kvzip-global`` has no predicted loss (its allocator decides its capacities at run time).
Usage::

    python bench/high_compression/objective_ranking.py PROFILE [PROFILE ...] [--mix continuation=1,retrieval=2 ...]

Prints one table per profile: a row per metric table (and mix of its objective tables), a column per task x budget.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
STUDY_PROFILE = os.path.join(HERE, "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
CONTEXT = 2048

SOLVED = {  # the study's solved policies (passkey_routed.json, niah.json, vt.json): solver, params
    "uniform-snapkv": ("uniform", {"mode": "best", "rule": "snapkv"}),
    "uniform-tova": ("uniform", {"mode": "best", "rule": "tova"}),
    "uniform-streamingllm": ("uniform", {"mode": "best", "rule": "streamingllm"}),
    "uniform-h2o": ("uniform", {"mode": "best", "rule": "h2o"}),
    "uniform-triattention": ("uniform", {"mode": "best", "rule": "triattention"}),
    "uniform-adakv": ("uniform", {"mode": "best", "rule": "adakv"}),
    "2d_hetero": ("moend-greedy", {"rule": "snapkv"}),
    "joint": ("exact", {}),
}
FILES = ("uniform-keydiff", "uniform-expected-attention", "kvzip-uniform", "kvzip-global", "joint-2048",
         "uniform-2048", "refine")

# Accuracy (passkey, niah: share of 20 items; variable tracking: mean score) from docs/results.md, sections
# "High-compression passkey on SmolLM2", "High-compression niah and variable tracking on SmolLM2" and
# "refine and a 2,048-token profile in the high-compression study" (refine's own niah run; joint-2048 and
# uniform-2048 ran on passkey only).
ACCURACY = {
    "passkey": {
        "8x": {"uniform-snapkv": .05, "uniform-tova": .10, "uniform-streamingllm": .40, "uniform-h2o": .10,
               "uniform-triattention": .10, "uniform-adakv": 0, "uniform-keydiff": .05,
               "uniform-expected-attention": .05, "2d_hetero": .20, "joint": .45, "kvzip-uniform": .70,
               "kvzip-global": .95, "joint-2048": .30, "uniform-2048": 0, "refine": .45},
        "12x": {"uniform-snapkv": 0, "uniform-tova": .05, "uniform-streamingllm": .15, "uniform-h2o": .10,
                "uniform-triattention": 0, "uniform-adakv": 0, "uniform-keydiff": 0,
                "uniform-expected-attention": 0, "2d_hetero": .05, "joint": .10, "kvzip-uniform": .55,
                "kvzip-global": .90, "joint-2048": .10, "uniform-2048": 0, "refine": .10}},
    "niah": {
        "8x": {"uniform-snapkv": .10, "uniform-tova": .20, "uniform-streamingllm": .50, "uniform-h2o": .30,
               "uniform-triattention": .05, "uniform-adakv": 0, "uniform-keydiff": 0,
               "uniform-expected-attention": .15, "kvzip-uniform": .35, "2d_hetero": .20, "joint": .35,
               "kvzip-global": .85, "refine": .40},
        "12x": {"uniform-snapkv": 0, "uniform-tova": .10, "uniform-streamingllm": .25, "uniform-h2o": .10,
                "uniform-triattention": .05, "uniform-adakv": 0, "uniform-keydiff": 0,
                "uniform-expected-attention": .10, "kvzip-uniform": 0, "2d_hetero": 0, "joint": .30,
                "kvzip-global": .70, "refine": .30}},
    "variable_tracking": {
        "8x": {"uniform-snapkv": .125, "uniform-tova": .175, "uniform-streamingllm": .275, "uniform-h2o": .20,
               "uniform-triattention": .05, "uniform-adakv": .175, "uniform-keydiff": .30,
               "uniform-expected-attention": .15, "kvzip-uniform": .20, "2d_hetero": .25, "joint": .40,
               "kvzip-global": .525, "refine": .40},
        "12x": {"uniform-snapkv": .125, "uniform-tova": .075, "uniform-streamingllm": .175, "uniform-h2o": .20,
                "uniform-triattention": 0, "uniform-adakv": .10, "uniform-keydiff": .20,
                "uniform-expected-attention": .05, "kvzip-uniform": .15, "2d_hetero": .10, "joint": .175,
                "kvzip-global": .575, "refine": .175}},
}
OBJECTIVE_TABLES = ("kl", "kl_reconstruction", "kl_retrieval")
DEFAULT_MIXES = ({"kl": 1, "kl_reconstruction": 1, "kl_retrieval": 1}, {"kl_reconstruction": 1, "kl_retrieval": 1},
                 {"kl": 1, "kl_retrieval": 1}, {"kl": 1, "kl_retrieval": 4}, {"kl": 1, "kl_reconstruction": 1})


def study_plans(budget: str) -> dict:
    """``{policy: plan}`` of the study at ``budget``: the solved policies re-solved as the study solves them, the
    plan files of ``plans/``."""
    from polykv.plan import load_plan
    from polykv.profiling.budget import Budget
    from polykv.profiling.profile import load_profile
    from polykv.solvers import solve

    profile = load_profile(STUDY_PROFILE)
    b = Budget.parse(budget, CONTEXT, basis="resident", cache_dtype="bfloat16")
    out = {name: solve(profile, b, solver, **params) for name, (solver, params) in SOLVED.items()}
    for name in FILES:
        path = os.path.join(HERE, "plans", f"{name}.{budget}.plan.json")
        if os.path.exists(path):
            out[name] = load_plan(path)
    return out


def ranking(profile, plans: dict, accuracy: dict, losses) -> tuple[float | None, float | None, int, list[str]]:
    """(rho, one-sided p, n, the policies counted once) of ``losses(plan)`` against ``accuracy`` over the distinct
    plans with a loss."""
    from polykv.errors import StudyError
    from polykv.profiling import stats

    seen, xs, ys, names = set(), [], [], []
    for name, acc in accuracy.items():
        plan = plans.get(name)
        if plan is None:
            continue
        key = repr(plan.layers) + repr(plan.allocation)
        if key in seen:  # refine at 8x kept the exact plan: counted once
            continue
        loss = losses(plan)
        if loss is None:
            continue
        seen.add(key)
        xs.append(loss)
        ys.append(acc)
        names.append(name)
    try:
        c = stats.spearman(xs, ys, seed=0, alternative="less")
    except StudyError:
        return None, None, len(xs), names
    return float(c.r), float(c.p_value), len(xs), names


def parse_mix(text: str) -> dict[str, float]:
    from polykv.profiling.objectives import METRIC_OF

    out = {}
    for part in text.split(","):
        name, _, w = part.partition("=")
        out[METRIC_OF.get(name, name)] = float(w)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--mix", action="append", default=[], metavar="NAME=W,...",
                    help="an objective mix to rank too (continuation/kl, reconstruction, retrieval = weight)")
    args = ap.parse_args(argv)

    from polykv.profiling.profile import load_profile
    from polykv.studies.predicted import SPEARMAN_CONVENTION, profile_loss

    plans = {b: study_plans(b) for b in ("8x", "12x")}
    cols = [(task, b) for task in ACCURACY for b in ("8x", "12x")]
    print(SPEARMAN_CONVENTION)
    for path in args.profiles:
        profile = load_profile(path)
        tables = [m for m in profile.metrics]
        have = [m for m in OBJECTIVE_TABLES if m in profile.metrics]
        mixes = [parse_mix(m) for m in args.mix] + ([m for m in DEFAULT_MIXES if set(m) <= set(have)]
                                                    if len(have) > 1 else [])
        rows = [(m, {m: 1.0}) for m in tables] + [(" + ".join(f"{w:g} {k}" for k, w in m.items()), m) for m in mixes]
        print(f"\n{path}")
        print("| metric | " + " | ".join(f"{t} {b}" for t, b in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for label, weights in rows:
            cells = []
            for task, b in cols:
                def losses(plan, weights=weights):
                    parts = [profile_loss(plan, profile, CONTEXT, m) for m in weights]
                    return None if any(x is None for x in parts) else float(np.dot(list(weights.values()), parts))

                rho, p, n, _ = ranking(profile, plans[b], ACCURACY[task][b], losses)
                cells.append("n/a" if rho is None else f"{rho:+.2f} (n = {n}, p = {p:.2f})")
            print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
