"""Write the KVzip plans of the high-compression passkey comparison (``passkey_kvzip.json``).

Each budget's plan takes the ``uniform`` solver's best SnapKV plan at that budget (the keep and K/V widths every
uniform rule gets at 8x-16x from the shipped profile) and runs ``kvzip`` instead of SnapKV on every layer:
``kvzip-uniform`` per layer (the reference's ``pair-uniform`` level) and ``kvzip-global`` with the ``kvzip``
allocator over all layers (the reference's default ``pair`` level: one ranking over layers x heads, ragged
per-head counts, the same total budget). The shipped profile has no kvzip rows, so no predicted loss is written.

    python bench/high_compression/make_kvzip_plans.py
"""

from __future__ import annotations

import os

import attrs

from polykv.adapters.rules.kvzip import prompt_params
from polykv.models.loading import load_default_model
from polykv.plan import AllocationGroup, OpSpec, Provenance
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.solvers import solve

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
BUDGETS = ("4x", "8x", "12x", "16x")


def main() -> None:
    _, tokenizer = load_default_model()
    params = prompt_params(tokenizer)
    profile = load_profile(PROFILE)
    os.makedirs(os.path.join(HERE, "plans"), exist_ok=True)
    for b in BUDGETS:
        budget = Budget.parse(b, 2048, basis="resident", cache_dtype="bfloat16")
        base = solve(profile, budget, "uniform", mode="best", rule="snapkv")
        layers = tuple(attrs.evolve(lp, prefill=OpSpec(rule="kvzip", capacity=lp.prefill.capacity,
                                                        capacity_ratio=lp.prefill.capacity_ratio, params=params))
                       for lp in base.layers)
        note = (f"kvzip on every layer with the keep and widths of the uniform solver's best snapkv plan at {b} "
                f"(resident basis, bfloat16 storage, 2048 tokens)")
        provenance = Provenance(solver="hand", budget=base.provenance.budget,
                                context_tokens=base.provenance.context_tokens, note=note + "; per layer (pair-uniform)")
        per_layer = attrs.evolve(base, layers=layers, provenance=provenance)
        per_layer.save(os.path.join(HERE, "plans", f"kvzip-uniform.{b}.plan.json"))
        group = AllocationGroup(allocator="kvzip", layers=tuple(range(len(layers))))
        global_ = attrs.evolve(per_layer, allocation=(group,), provenance=attrs.evolve(
            per_layer.provenance, note=note + "; one ranking over layers x heads (allocator kvzip, level pair)"))
        global_.save(os.path.join(HERE, "plans", f"kvzip-global.{b}.plan.json"))
        print(f"wrote kvzip-uniform.{b} and kvzip-global.{b}")


if __name__ == "__main__":
    main()
