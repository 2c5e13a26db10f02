"""Shipped plans: nominal ratio, predicted resident ratio and measured resident ratio, side by side.

For every plan file it prints, at the plan's budgeted context T (``provenance.context_tokens``):

* the **nominal** ratio: a 16-bit full cache over MoE-nD's codes-only bytes (:func:`polykv.memory.nominal_bytes`);
* the **predicted** resident ratio: a 16-bit full cache over the memory model's bytes with metadata
  (:func:`polykv.memory.held_bytes_per_layer`, bfloat16 storage);
* the **measured** resident ratio: a 16-bit full cache over the bytes the runtime holds after prefilling
  T tokens on the model (K/V stores with scales, minima and residuals, plus positions and rule state),
  stored in bfloat16 while the model computes in float32;
* the budget the plan was solved for, its basis, and how far the measured bytes sit from it.

The prompt is the offline corpus's text (no download); the model runs the prefill once and every plan
is restored from that snapshot (exactly what a separate prefill would hold).

    python bench/plan_memory.py                     # every plans/smollm2-135m-instruct.*.plan.json
    python bench/plan_memory.py --context 2048 plans/x.plan.json   # another length (ratio capacities)
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "profiles", "smollm2-135m-instruct.profile.json")


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    """``tokens`` token ids of offline prose (the studies' corpus), repeated if needed."""
    from polykv.models.corpus import corpus_texts

    ids: list[int] = []
    for text in corpus_texts("mixed", 64, min_chars=2000, seed=0):
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            break
    while len(ids) < tokens:
        ids += ids
    return torch.tensor([ids[:tokens]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="*", help="plan files (default: the shipped SmolLM2 plans)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens (default: each plan's budgeted T)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import polykv
    from polykv.models.geometry import geometry_of_model
    from polykv.memory import full_cache_bytes_16bit, held_bytes_per_layer, nominal_bytes
    from polykv.models import load_default_model
    from polykv.plan import load_plan
    from polykv.registry import get_registry
    from polykv.runtime.fork import capture_prefill, restore_prefill
    from polykv.studies.runner import _model_data

    paths = args.plans or sorted(glob.glob(os.path.join(ROOT, "plans", "smollm2-135m-instruct.*.plan.json")))
    registry = get_registry()
    plans = {p: load_plan(p, registry=registry) for p in paths}
    model, tokenizer = load_default_model()
    geo = geometry_of_model(model)
    model_data = _model_data(model, tokenizer, list(plans.values()), PROFILE)
    by_context: dict[int, list[str]] = {}
    for p, plan in plans.items():
        by_context.setdefault(args.context or plan.provenance.context_tokens or 2048, []).append(p)
    head = (f"{'plan':<48} {'basis':<8} {'budget':>6} {'T':>5} {'nominal':>8} {'predicted':>9} {'measured':>9} "
            f"{'measured/budget':>15}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for T, group in sorted(by_context.items()):
        ids = prompt_ids(tokenizer, T)
        with torch.no_grad():
            snap = capture_prefill(model, ids, [plans[p] for p in group], registry=registry)
            full16 = full_cache_bytes_16bit(geo, T)
            for p in group:
                plan = plans[p]
                with polykv.apply(model, plan, model_data=model_data, registry=registry,
                                  storage_dtype=torch.bfloat16) as session:
                    restore_prefill(session, snap)
                    held = session.resident_bytes()
                measured = held.total + held.metadata_total
                predicted = sum(held_bytes_per_layer(plan, geo, T, dtype_bytes=2))
                nominal = sum(nominal_bytes(plan, geo, T))
                budget = (plan.provenance.budget or {}).get("ratio")
                basis = plan.provenance.basis or "nominal"
                vs = f"{measured / (full16 / budget):.4f}" if budget else "-"
                if budget and basis == "resident":
                    worst = max(worst, abs(measured / (full16 / budget) - 1))
                print(f"{os.path.basename(p).replace('smollm2-135m-instruct.', ''):<48} {basis:<8} "
                      f"{(str(budget) + 'x') if budget else '-':>6} {T:>5} {full16 / nominal:7.2f}x "
                      f"{full16 / predicted:8.2f}x {full16 / measured:8.2f}x {vs:>15}")
    print(f"\nratios: a 16-bit full cache ({geo.num_layers} layers x {geo.num_kv_heads} KV heads x {geo.head_dim} "
          f"x 2 bytes x K,V per token) over the plan's bytes; measured = K/V stores + metadata after prefill, "
          f"bfloat16 storage, float32 compute. Resident-basis plans: measured bytes within "
          f"{worst:.2%} of their budget.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
