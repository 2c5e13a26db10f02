"""Passkey retrieval on the default model for every built-in rule at 4x and 8x context compression.

Writes one uniform plan per (rule, ratio) — the rule compresses the context in the prefill phase to
the given fraction of its tokens, everything else full and 16-bit — plus, for every rule that has an
allocator of the same name (PyramidKV, CAKE, D2O), a plan whose layers form one allocation group so
the method's own layer budgets apply (``<rule>+alloc``), plus CaM around H2O (``cam-h2o``); then a
study spec, runs it with ``polykv study`` (context compressed before the question is fed through the
cache) and prints the report table. Usage::

    python bench/passkey_rules.py [--samples 10] [--length 2048] [--filler code] [--out results/passkey-rules]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import attrs

import polykv
from polykv.models import default_geometry
from polykv.plan import AllocationGroup, OpSpec
from polykv.registry import get_registry

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "profiles", "smollm2-135m-instruct.profile.json")


def probe_params(rule: str, registry) -> dict:
    """The token-id parameters a probe rule needs for the default model's tokenizer (kvzip), else none."""
    if rule != "kvzip":
        return {}
    from polykv.adapters.rules.kvzip import prompt_params
    from polykv.models import load_default_model

    return prompt_params(load_default_model()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--ratios", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--out", default="results/passkey-rules")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the passkey items (another seed, other items)")
    ap.add_argument("--filler", default="code", help="passkey filler corpus: code or prose")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    geo = default_geometry()
    registry = get_registry()
    plans = {}

    def add(name: str, plan) -> None:
        path = os.path.abspath(os.path.join(args.out, f"{name}.plan.json"))
        plan.save(path)
        plans[name] = path

    everything = tuple(range(geo.num_layers))
    for rule in registry.names("rule"):
        if rule == "full" or "prefill" not in registry.rule(rule).phases:
            continue
        params = probe_params(rule, registry)
        for ratio in args.ratios:
            plan = polykv.uniform_plan(geo, prefill=OpSpec(rule=rule, capacity_ratio=1.0 / ratio, params=params))
            add(f"{rule}-{ratio:g}x", plan)
            if registry.has("allocator", rule):
                add(f"{rule}+alloc-{ratio:g}x",
                    attrs.evolve(plan, allocation=(AllocationGroup(allocator=rule, layers=everything),)))
    if registry.has("rule", "cam"):
        for ratio in args.ratios:
            op = OpSpec(rule="cam", capacity_ratio=1.0 / ratio, params={"rule": "h2o"})
            add(f"cam-h2o-{ratio:g}x", polykv.uniform_plan(geo, prefill=op))
    spec = {"name": "passkey-rules", "model": "default", "context_tokens": args.length,
            "profile": os.path.abspath(PROFILE), "baseline": True, "plans": plans,
            "tasks": [{"task": "passkey", "params": {"length": args.length, "filler": args.filler}, "samples": args.samples, "seed": args.seed}]}
    spec_path = os.path.join(args.out, "spec.json")
    with open(spec_path, "w") as fh:
        json.dump(spec, fh, indent=2)
    results = os.path.join(args.out, "results.jsonl")
    run = [sys.executable, "-m", "polykv", "study", spec_path, "--results", results, "--threads", str(args.threads)]
    subprocess.run(run, check=True)
    subprocess.run([sys.executable, "-m", "polykv", "report", results, "-o", args.out], check=True)
    with open(os.path.join(args.out, "report.md")) as fh:
        print(fh.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
