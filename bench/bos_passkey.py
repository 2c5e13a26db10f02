"""The demo's passkey study with the BOS token forced on and off: does the attention sink matter?

Derives two specs from ``examples/demo_study.json`` (same model, profile, solvers, task and items)
that differ only in ``"bos"`` (true / false) and keep the budgets given (default the demo's 8x),
runs both with the same loaded model, writes both reports and prints one table: accuracy with its
Wilson 95% interval and measured KV MiB per policy, BOS off beside BOS on, with the wall time of each
study. Usage::

    python bench/bos_passkey.py [--samples 20] [--budgets 8x] [--out results/bos-passkey] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "..", "examples", "demo_study.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--budgets", nargs="+", default=["8x"])
    ap.add_argument("--out", default="results/bos-passkey")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from polykv.studies.report import policy_rows, write_report
    from polykv.studies.results import Results
    from polykv.studies.runner import load_model, prepare, run_study
    from polykv.studies.spec import load_spec

    torch.set_num_threads(args.threads)
    with open(DEMO) as fh:
        demo = json.load(fh)
    os.makedirs(args.out, exist_ok=True)
    model = tokenizer = None
    rows, wall = {}, {}
    for bos in (False, True):
        tag = "bos-on" if bos else "bos-off"
        spec = copy.deepcopy(demo)
        spec.update(name=f"demo-{tag}", budgets=list(args.budgets), bos=bos,
                    profile=os.path.abspath(os.path.join(os.path.dirname(DEMO), demo["profile"])))
        spec["tasks"][0]["samples"] = args.samples
        spec_path = os.path.join(args.out, f"{tag}.spec.json")
        with open(spec_path, "w") as fh:
            json.dump(spec, fh, indent=2)
        loaded = load_spec(spec_path)
        results = os.path.join(args.out, f"{tag}.results.jsonl")
        prepared = prepare(loaded, results)
        if model is None:
            model, tokenizer = load_model(loaded)
        start = time.perf_counter()
        counts = run_study(prepared, model=model, tokenizer=tokenizer, progress=False)
        wall[tag] = time.perf_counter() - start
        print(f"{tag}: ran {counts['run']}, skipped {counts['skipped']} in {wall[tag]:.0f} s -> {results}", flush=True)
        write_report(results, os.path.join(args.out, tag))
        res = Results.load(results)
        firsts = {r["bos_first"] for r in res.results}
        print(f"{tag}: first stored token is the BOS: {sorted(firsts)}")
        rows[tag] = {r["policy"]: r for r in policy_rows(res, "passkey")}

    print("\n| policy | BOS off: accuracy [95%] | BOS on: accuracy [95%] | KV MiB off | KV MiB on |")
    print("|---|---|---|---|---|")
    for name in rows["bos-off"]:
        off, on = rows["bos-off"][name], rows["bos-on"][name]
        print(f"| {name} | {_acc(off)} | {_acc(on)} | {off['bytes'] / 2 ** 20:.2f} | {on['bytes'] / 2 ** 20:.2f} |")
    print(f"\nwall: BOS off {wall['bos-off']:.0f} s, BOS on {wall['bos-on']:.0f} s (threads={args.threads})")
    return 0


def _acc(row) -> str:
    w = row["wilson"]
    return f"{row['k']}/{row['n']} = {row['mean']:.0%} [{w.low:.0%}, {w.high:.0%}]"


if __name__ == "__main__":
    raise SystemExit(main())
