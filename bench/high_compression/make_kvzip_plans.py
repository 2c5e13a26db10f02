"""Write the KVzip plans of the high-compression comparisons (``passkey_kvzip.json``, the Gemma 3 study).

Each budget's plan takes the ``uniform`` solver's best plan of rule ``--from-rule`` at that budget (the keep and
K/V widths that rule gets at 4x-16x from the profile) and runs ``kvzip`` instead on every layer it compresses:
``kvzip-uniform`` per layer (the reference's ``pair-uniform`` level; with ``--from-rule kvzip`` it is the
uniform solver's own kvzip plan, which a study solves itself, so no file is written) and ``kvzip-global`` with the ``kvzip``
allocator over those layers (the reference's default ``pair`` level: one ranking over layers x heads, ragged
per-head counts, the same total budget). Window-bounded layers (Gemma 3's sliding layers) keep their window
and join no group. No predicted loss is written: the allocator decides each head's count at run time.

    python bench/high_compression/make_kvzip_plans.py
    python bench/high_compression/make_kvzip_plans.py --model gemma3-270m --from-rule kvzip \\
        --profile bench/high_compression/profiles/gemma3-270m-2048.profile.json --name gemma3-270m.
"""

from __future__ import annotations

import argparse
import os

import attrs

from polykv.adapters.rules.kvzip import prompt_params
from polykv.models.loading import load_model
from polykv.plan import AllocationGroup, OpSpec, Provenance
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.solvers import solve

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
BUDGETS = ("4x", "8x", "12x", "16x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--from-rule", default="snapkv", help="the uniform plan whose keep and widths kvzip takes")
    ap.add_argument("--name", default="", help="prefix of the plan file names (e.g. 'gemma3-270m.')")
    ap.add_argument("--budgets", default=",".join(BUDGETS))
    args = ap.parse_args()
    _, tokenizer = load_model(args.model)
    params = prompt_params(tokenizer)
    profile = load_profile(args.profile)
    os.makedirs(os.path.join(HERE, "plans"), exist_ok=True)
    for b in args.budgets.split(","):
        budget = Budget.parse(b, 2048, basis="resident", cache_dtype="bfloat16")
        base = solve(profile, budget, "uniform", mode="best", rule=args.from_rule)
        compressed = [lp.layer for lp in base.layers if lp.prefill.rule != "full"]
        note = (f"kvzip on every compressed layer with the keep and widths of the uniform solver's best "
                f"{args.from_rule} plan at {b} (resident basis, bfloat16 storage, 2048 tokens)")
        if args.from_rule == "kvzip":
            per_layer = attrs.evolve(base, provenance=attrs.evolve(base.provenance, note=note + "; per layer "
                                                                   "(pair-uniform)"))
        else:
            layers = tuple(lp if lp.prefill.rule == "full" else attrs.evolve(lp, prefill=OpSpec(
                rule="kvzip", capacity=lp.prefill.capacity, capacity_ratio=lp.prefill.capacity_ratio, params=params))
                for lp in base.layers)
            provenance = Provenance(solver="hand", budget=base.provenance.budget,
                                    context_tokens=base.provenance.context_tokens, note=note + "; per layer (pair-uniform)")
            per_layer = attrs.evolve(base, layers=layers, provenance=provenance)
        if args.from_rule != "kvzip":  # else a study solves it itself (uniform, rule kvzip)
            per_layer.save(os.path.join(HERE, "plans", f"{args.name}kvzip-uniform.{b}.plan.json"))
        group = AllocationGroup(allocator="kvzip", layers=tuple(compressed))
        global_ = attrs.evolve(per_layer, allocation=(group,), provenance=Provenance(
            solver="hand", budget=base.provenance.budget, context_tokens=base.provenance.context_tokens,
            note=note + "; one ranking over layers x heads (allocator kvzip, level pair)"))
        global_.save(os.path.join(HERE, "plans", f"{args.name}kvzip-global.{b}.plan.json"))
        print(f"wrote {args.name}kvzip-global.{b} (kvzip on layers {compressed})")


if __name__ == "__main__":
    main()
