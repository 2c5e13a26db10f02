"""Solver benchmark: median solve time and the greedy-vs-exact loss gap.

    python bench/solvers.py                      # random tables, 28 x 54 and 80 x 270
    python bench/solvers.py --profile FILE.json  # also the gap on a measured profile

Times are medians of ``--repeats`` full ``solve`` calls (plan building and provenance included) at
budgets of 1/8, 1/4 and 1/2 of a full 16-bit cache. Two kinds of random table: ``iid`` (uniform
noise, no structure) and ``monotone`` (loss falls with keep and with each bit width, plus noise,
like a measured profile). 80 x 270 is five rules x the 54-config MoE-nD grid; the greedy walks
one rule's grid (the first rule), the timed exact solve chooses among all 270 configs. The loss gap
is reported against the exact optimum on the greedy's own grid (the algorithmic gap) and, for
270 configs, against the exact optimum over all configs (what mixing rules adds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from polykv.profiling.budget import Budget, full_cache_bytes
from polykv.profiling.profile import Profile, load_profile, moend_configs
from polykv.registry import get_registry

RULES = ("triattention", "tova", "h2o", "streamingllm", "key-norm")
FRACTIONS = (1 / 8, 1 / 4, 1 / 2)


def random_profile(rng, layers: int, rules: int, kind: str) -> Profile:
    configs = [c for r in RULES[:rules] for c in moend_configs(r)]
    if kind == "iid":
        table = rng.random((layers, len(configs)))
    else:
        keep = np.array([c.keep for c in configs])
        kb = np.array([c.k_bits for c in configs])
        vb = np.array([c.v_bits for c in configs])
        a, b, c = rng.uniform(0.1, 1.0, (3, layers, 1))
        rule_bias = rng.uniform(0.8, 1.2, (layers, rules)).repeat(54, axis=1)
        table = rule_bias * (a * (1 - keep) + b * np.log2(16 / kb) + c * np.log2(16 / vb))
        table += rng.uniform(0, 0.02, table.shape) * (keep < 1)
    return Profile.from_table(table, configs, (layers, 2, 128))


def timed(solver, profile, budget, repeats, **params):
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = solver.solve(profile, budget, **params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), plan


def run_shape(layers, rules, kind, args, reg):
    greedy, exact = reg.solver("moend-greedy")(), reg.solver("exact")()
    rng = np.random.default_rng(args.seed)
    gaps, gaps_all, t_g, t_e = [], [], [], []
    for trial in range(args.tables):
        profile = random_profile(rng, layers, rules, kind)
        full = full_cache_bytes(profile.model, args.context)
        for frac in FRACTIONS:
            budget = Budget.of_bytes(int(full * frac), args.context)
            reps = args.repeats if trial == 0 else 1
            tg, pg = timed(greedy, profile, budget, reps, rule=RULES[0])
            te, pe = timed(exact, profile, budget, reps)
            if trial == 0:
                t_g.append(tg)
                t_e.append(te)
            same = exact.solve(profile, budget, rules=[RULES[0]]) if rules > 1 else pe
            lg, le, la = pg.provenance.predicted_loss, same.provenance.predicted_loss, pe.provenance.predicted_loss
            assert la <= le + 1e-9 and le <= lg + 1e-9, "exact lost to greedy"
            gaps.append((lg - le) / max(le, 1e-12))
            gaps_all.append((lg - la) / max(la, 1e-12))
    print(f"{layers:>3} x {len(RULES[:rules]) * 54:<4} {kind:<9} "
          f"greedy {1e3 * statistics.median(t_g):7.2f} ms   exact {1e3 * statistics.median(t_e):7.2f} ms   "
          f"exact/greedy {statistics.median(t_e) / statistics.median(t_g):5.2f}x   "
          f"greedy loss above exact on its grid: median {100 * statistics.median(gaps):6.2f}%  "
          f"max {100 * max(gaps):6.2f}%" + (f"; above exact on all configs: median "
                                              f"{100 * statistics.median(gaps_all):6.2f}%" if rules > 1 else "")
          + f"  ({len(gaps)} table x budget pairs)")


def run_profile(path, args, reg):
    profile = load_profile(path)
    greedy, exact = reg.solver("moend-greedy")(), reg.solver("exact")()
    full = full_cache_bytes(profile.model, args.context)
    print(f"profile {path}: {profile.num_layers} layers x {len(profile.configs)} configs, metric "
          f"{profile.default_metric}")
    for frac in FRACTIONS:
        budget = Budget.of_bytes(int(full * frac), args.context)
        tg, pg = timed(greedy, profile, budget, args.repeats, rule=args.rule)
        te, pe = timed(exact, profile, budget, args.repeats)
        lg, le = pg.provenance.predicted_loss, pe.provenance.predicted_loss
        print(f"  budget {frac:.3f} of full: greedy loss {lg:.6g} ({1e3 * tg:.2f} ms), exact loss {le:.6g} "
              f"({1e3 * te:.2f} ms), gap {100 * (lg - le) / max(le, 1e-12):.2f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a measured profile file to report the gap on")
    ap.add_argument("--rule", default=None, help="rule whose grid the greedy walks on --profile")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=21, help="timed solves per shape and budget")
    ap.add_argument("--tables", type=int, default=20, help="random tables per shape for the loss gap")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    reg = get_registry()
    print(f"context T={args.context}, budgets {', '.join(f'{f:.3f}' for f in FRACTIONS)} of a full 16-bit cache; "
          f"times are medians of {args.repeats} solves")
    for layers, rules in ((28, 1), (80, 5)):
        for kind in ("iid", "monotone"):
            run_shape(layers, rules, kind, args, reg)
    if args.profile:
        run_profile(args.profile, args, reg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
