"""Write the KVzip plans of the high-compression comparisons (``passkey_kvzip.json``, the Gemma 3 study).

Each budget's plans take the K/V widths of the ``uniform`` solver's best plan of rule ``--from-rule`` at that
budget (from ``--profile``) and run ``kvzip`` on every layer at the largest keep that fits:

* ``kvzip-global``: the ``global`` solver (``polykv solve --solver global --param allocator=kvzip --param rules='["kvzip"]'
  --param shares=uniform --param k_bits=K --param v_bits=V``, on ``--group-profile``, which measured kvzip): every
  layer in one ``kvzip`` allocation group (the reference's default ``pair`` level: one ranking over layers x
  heads, ragged per-head counts, the same total budget);
* ``kvzip-uniform``: the same layers without the group (the reference's ``pair-uniform`` level). With
  ``--from-rule kvzip`` it is the uniform solver's own kvzip plan, which a study solves itself, so no file is
  written.

Window-bounded layers (Gemma 3's sliding layers) keep their window and join no group.

    python bench/high_compression/make_kvzip_plans.py
    python bench/high_compression/make_kvzip_plans.py --from-rule kvzip --name gemma3-270m. \\
        --profile bench/high_compression/profiles/gemma3-270m-2048.profile.json \\
        --group-profile bench/high_compression/profiles/gemma3-270m-2048.profile.json
"""

from __future__ import annotations

import argparse
import os

import attrs

from polykv.plan import Provenance
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.solvers import solve

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
GROUP_PROFILE = os.path.join(HERE, "profiles", "smollm2-135m-instruct-2048.profile.json")
BUDGETS = ("4x", "8x", "12x", "16x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=PROFILE, help="the profile the uniform widths come from")
    ap.add_argument("--group-profile", default=GROUP_PROFILE, help="a profile that measured kvzip (the global "
                    "solver's)")
    ap.add_argument("--from-rule", default="snapkv", help="the uniform plan whose widths kvzip takes")
    ap.add_argument("--name", default="", help="prefix of the plan file names (e.g. 'gemma3-270m.')")
    ap.add_argument("--budgets", default=",".join(BUDGETS))
    args = ap.parse_args()
    profile, group_profile = load_profile(args.profile), load_profile(args.group_profile)
    os.makedirs(os.path.join(HERE, "plans"), exist_ok=True)
    for b in args.budgets.split(","):
        budget = Budget.parse(b, 2048, basis="resident", cache_dtype="bfloat16")
        base = solve(profile, budget, "uniform", mode="best", rule=args.from_rule)
        widths = next((lp.k_bits, lp.v_bits) for lp in base.layers if lp.prefill.rule != "full")
        global_ = solve(group_profile, budget, "global", allocator="kvzip", rules=["kvzip"], shares="uniform",
                        k_bits=widths[0], v_bits=widths[1])
        global_.save(os.path.join(HERE, "plans", f"{args.name}kvzip-global.{b}.plan.json"))
        print(f"wrote {args.name}kvzip-global.{b}: {global_.provenance.note}")
        if args.from_rule != "kvzip":  # else a study solves it itself (uniform, rule kvzip)
            note = (f"kvzip on every compressed layer of the global solver's plan at {b} (K{widths[0]} V{widths[1]}, "
                    f"the widths of the uniform solver's best {args.from_rule} plan), without its allocation group "
                    "(per layer, pair-uniform)")
            per_layer = attrs.evolve(global_, allocation=(), provenance=Provenance(
                solver="hand", budget=global_.provenance.budget, context_tokens=global_.provenance.context_tokens,
                note=note))
            per_layer.save(os.path.join(HERE, "plans", f"{args.name}kvzip-uniform.{b}.plan.json"))


if __name__ == "__main__":
    main()
