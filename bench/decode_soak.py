"""Decode-memory soak: every decode rule x K/V bits x decode slack on a tiny model, thousands of decode
steps each; the worst store bytes measured after any forward beside the memory model's decode bound.

The cache is driven directly (random post-RoPE keys, values and queries through the runtime's attention,
eviction and stores), see :func:`polykv.testing.decode_soak`. Usage::

    python bench/decode_soak.py [--steps 3000] [--capacity 64] [--context 96] [--bits 16 8 4 2]
                                [--slacks 1 16 128] [--rules h2o tova ...]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4, 2])
    ap.add_argument("--slacks", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--rules", nargs="+", default=None, help="default: every registered rule that runs in decode")
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--residual", type=int, default=16)
    args = ap.parse_args()

    import torch

    from polykv.models.geometry import geometry_of_model
    from polykv.plan import uniform_plan
    from polykv.adapters.rules.query_stats import compute_query_stats
    from polykv.registry import get_registry
    from polykv.testing import decode_soak, tiny_model

    torch.set_num_threads(1)
    registry = get_registry()
    rules = args.rules or [r for r in registry.names("rule") if "decode" in registry.rule(r).phases]
    model = tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=args.head_dim, vocab=64)
    geo = geometry_of_model(model)
    ids = torch.randint(1, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    data = {"triattention": compute_query_stats(model, [ids[:1], ids[1:]])}
    print(f"tiny llama: 1 layer, {geo.num_heads} heads, {geo.num_kv_heads} KV head, head_dim {geo.head_dim}, "
          f"float32; decode capacity {args.capacity}, context {args.context}, {args.steps} decode steps; kivi "
          f"group_size {args.group_size}, residual {args.residual}")
    print(f"{'rule':<13} {'bits':>4} {'slack':>5} {'worst B':>8} {'bound B':>8} {'worst/bound':>11} "
          f"{'over':>4} {'s':>5}")
    failed = 0
    for rule in rules:
        for bits in args.bits:
            for slack in args.slacks:
                plan = uniform_plan(geo, decode=rule, capacity=None if rule == "full" else args.capacity,
                                    k_bits=bits, v_bits=bits, decode_slack=slack,
                                    quantizer_params={"group_size": args.group_size, "residual": args.residual})
                start = time.perf_counter()
                worst, bound, over = decode_soak(model, plan, context_tokens=args.context, steps=args.steps,
                                                 model_data=data)
                failed += sum(over)
                print(f"{rule:<13} {bits:>4} {slack:>5} {worst[0]:>8} {bound[0]:>8} {worst[0] / bound[0]:>11.2f} "
                      f"{over[0]:>4} {time.perf_counter() - start:>5.1f}", flush=True)
    print("all within the bound" if not failed else f"{failed} forwards above the bound")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
