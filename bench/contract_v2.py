"""SmolLM2 end to end on the v2 operator contract: ragged heads, merges and an allocation group in one plan.

Layers 0-9 run a head-wise rule (KV heads keep 1:2:3 shares of the layer's budget, ragged storage),
layers 10-19 a merging rule in both phases (evicted values, and keys in decode, folded into the
oldest kept token), layers 20-29 key-norm under an allocator that redistributes their total budget
after prefill. The rules and the allocator are the small ones the runtime tests use
(``tests/runtime/v2_plugins.py``), registered in a private registry. Prints measured resident bytes
against the memory model's prediction (given the per-head counts and the allocations the runtime
reports), the per-head counts, the budgets, and a 64-token greedy generation.

    PYTHONPATH=. python bench/contract_v2.py [--context 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.memory import predict_resident
from polykv.models import load_default_model
from polykv.plan import AllocationGroup, OpSpec, per_layer_plan


def main() -> None:
    from tests.runtime.v2_plugins import registry_with_plugins

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_default_model()
    geo = geometry_of_model(model)
    registry = registry_with_plugins()
    T, cap = args.context, args.context // 8
    ids = torch.randint(1, 40000, (1, T), generator=torch.Generator().manual_seed(0))
    layers = []
    for i in range(geo.num_layers):
        if i < 10:
            layers.append({"prefill": OpSpec(rule="test-headwise", capacity=cap)})
        elif i < 20:
            layers.append({"prefill": OpSpec(rule="test-merge", capacity=cap),
                           "decode": OpSpec(rule="test-merge", capacity=cap, params={"keys": True})})
        else:
            layers.append({"prefill": OpSpec(rule="key-norm", capacity=cap)})
    plan = attrs.evolve(per_layer_plan(geo, layers, decode_slack=8),
                        allocation=(AllocationGroup(allocator="test-layer-share", layers=tuple(range(20, 30))),))
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        start = time.perf_counter()
        session.prefill(ids)
        print(f"prefill + selection: {time.perf_counter() - start:.1f} s")
        counts, alloc, got = session.cache.head_counts(), session.allocations(), session.resident_bytes()
        want = predict_resident(plan, geo, T, dtype_bytes=4, registry=registry, head_counts=counts, allocations=alloc)
        print(f"resident K/V bytes: measured {got.total:,}, predicted {sum(r.resident_bytes for r in want):,}, "
              f"equal per layer: {list(got.per_layer) == [r.resident_bytes for r in want]}")
        print(f"metadata equal per layer: {[dict(m) for m in got.metadata_per_layer] == [r.metadata for r in want]}")
        print(f"per-head counts, layers 0-2: {counts[:3]}")
        budgets = [alloc[i]["budget"] for i in range(20, 30)]
        print(f"allocated budgets, layers 20-29: {budgets} (sum {sum(budgets)}, planned total {10 * cap})")
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        print(f"generate 64 tokens: {time.perf_counter() - start:.1f} s, {out.shape[1] - T} new tokens; "
              f"stored per layer after: {session.cache.stored_tokens()}")
        print(f"merge writes, layer 10: {session.cache.layers[10].storage.write_cost}")


if __name__ == "__main__":
    main()
