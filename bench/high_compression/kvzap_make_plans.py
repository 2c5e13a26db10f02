"""Write ``kvzap (global)`` plans from the ``kvzip-global`` ones: the same layers, widths, capacities and one
allocation group, with rule and allocator ``kvzap`` (no probe; the shipped surrogate named in ``model_data``).

    python bench/high_compression/kvzap_make_plans.py            # plans/kvzap-global.{4x,8x}.plan.json
    python bench/high_compression/kvzap_make_plans.py --model gemma3-270m --budgets 8x
                                                                 # plans/gemma3-270m.kvzap-global.8x.plan.json
"""

from __future__ import annotations

import argparse
import os

import attrs

from polykv.plan import AllocationGroup, OpSpec, Provenance, load_plan

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILES = os.path.join(HERE, "..", "..", "profiles")
MODELS = {"default": ("", "smollm2-135m-instruct.kvzap.safetensors"),
          "gemma3-270m": ("gemma3-270m.", "gemma3-270m.kvzap.safetensors")}
"""Per model: the plan files' prefix and the shipped surrogate's file name under profiles/."""


def kvzap_plan(plan, surrogate: str):
    """``plan`` with every kvzip op and group turned into kvzap (the kvzip prompt ids dropped)."""
    layers = tuple(attrs.evolve(lp, prefill=OpSpec(rule="kvzap", capacity=lp.prefill.capacity,
                                                   capacity_ratio=lp.prefill.capacity_ratio))
                   if lp.prefill.rule == "kvzip" else lp for lp in plan.layers)
    groups = tuple(AllocationGroup(allocator="kvzap", layers=g.layers) if g.allocator == "kvzip" else g
                   for g in plan.allocation)
    note = f"kvzap in place of kvzip in {plan.provenance.note}"
    return attrs.evolve(plan, layers=layers, allocation=groups, model_data={"kvzap": os.path.abspath(surrogate)},
                        provenance=Provenance(solver="hand", budget=plan.provenance.budget,
                                              context_tokens=plan.provenance.context_tokens, note=note))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="4x,8x")
    ap.add_argument("--model", choices=sorted(MODELS), default="default")
    args = ap.parse_args()
    prefix, surrogate = MODELS[args.model]
    for b in args.budgets.split(","):
        src = load_plan(os.path.join(HERE, "plans", f"{prefix}kvzip-global.{b}.plan.json"))
        kvzap_plan(src, os.path.join(PROFILES, surrogate)).save(
            os.path.join(HERE, "plans", f"{prefix}kvzap-global.{b}.plan.json"))
        print(f"wrote plans/{prefix}kvzap-global.{b}.plan.json")


if __name__ == "__main__":
    main()
