"""One shipped profile and plan in several compute dtypes: passkey accuracy of the shipped 8x plan and the
full cache, float32 beside bfloat16 (and float16 where the device runs it).

The plan and profile are used as shipped (calibrated in float32); the model fingerprint does not depend
on the dtype, so the study accepts them in every dtype. Usage::

    python bench/dtype_passkey.py [--samples 10] [--length 2048] [--dtypes float32 bfloat16]
                                  [--plan plans/smollm2-135m-instruct.exact.8x.plan.json] [--out results/dtype-passkey]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--plan", default=os.path.join(ROOT, "plans", "smollm2-135m-instruct.exact.8x.plan.json"))
    ap.add_argument("--out", default="results/dtype-passkey")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from polykv.studies.results import Results
    from polykv.studies.runner import prepare, run_study
    from polykv.studies.spec import load_spec
    from polykv.profiling.stats import wilson_interval as wilson

    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for dtype in args.dtypes:
        spec = {"name": f"dtype-passkey-{dtype}", "model": "default", "dtype": dtype, "context_tokens": args.length,
                "profile": os.path.join(ROOT, "profiles", "smollm2-135m-instruct.profile.json"), "baseline": True,
                "plans": {"plan8x": os.path.abspath(args.plan)},
                "tasks": [{"task": "passkey", "params": {"length": args.length}, "samples": args.samples, "seed": 0}]}
        spec_path = os.path.join(args.out, f"spec-{dtype}.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh, indent=2)
        results = os.path.join(args.out, f"results-{dtype}.jsonl")
        start = time.perf_counter()
        counts = run_study(prepare(load_spec(spec_path), results), progress=False)
        seconds = time.perf_counter() - start
        res = Results.load(results)
        for policy in res.policy_names():
            scores = res.scores(policy, "passkey")
            kv = res.field(policy, "passkey", "kv_bytes")
            w = wilson(int(scores.sum()), len(scores))
            rows.append((dtype, policy, f"{int(scores.sum())}/{len(scores)}", f"[{w.low:.0%}, {w.high:.0%}]",
                         f"{kv.mean() / 2 ** 20:.3f}", f"{seconds:.0f}" if policy == res.policy_names()[0] else "",
                         counts["run"]))
    print(f"passkey, {args.samples} items, {args.length} tokens, plan {os.path.relpath(args.plan, ROOT)}")
    print(f"{'dtype':<9} {'policy':<7} {'correct':>7} {'Wilson 95%':>12} {'KV MiB':>7} {'seconds':>7} {'ran':>4}")
    for r in rows:
        print(f"{r[0]:<9} {r[1]:<7} {r[2]:>7} {r[3]:>12} {r[4]:>7} {r[5]:>7} {r[6]:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
