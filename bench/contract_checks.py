"""What the plugin contract checks cost per decode step (polykv.runtime.plugin_results), in one process.

Runs the same greedy decode loop (one model forward per token) under one plan three ways, interleaved
round by round so that machine noise hits all three alike:

* ``none``: the checks added by the contract layer patched out (the score-shape check, the store
  checks after every append/gather/write/read and the byte check after prefill; the selection checks
  the runtime made before stay, as they always ran);
* ``cheap``: the default (``check=False``): the always-on checks;
* ``full``: ``check=True`` (what ``POLYKV_CHECK=1`` turns on): the expensive checks too.

Prints the median seconds per decode step of each and the ratios against ``none`` (on a shared machine
these ratios carry the noise of whole steps), then the time spent inside the check functions themselves
per decode step (timed around each call, so it is free of that noise) as a share of the step. The plan evicts
with ``key-norm`` every other step (decode slack 1) and quantizes the first half of the layers with KIVI
at 4 bits, so every kind of store call runs. Usage::

    python bench/contract_checks.py [--default-model] [--context 512] [--steps 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

import polykv
from polykv.runtime import plugin_results as contract_checks
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec, per_layer_plan
from polykv.testing import tiny_model


def decode_seconds(model, plan, ids: torch.Tensor, steps: int, check: bool) -> float:
    """Seconds per decode step: prefill ``ids``, then ``steps`` greedy forwards of one token."""
    with torch.no_grad(), polykv.apply(model, plan, check=check) as session:
        cache = session.new_cache()
        out = model(ids, use_cache=True, **{session.cache_keyword: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, use_cache=True, **{session.cache_keyword: cache})
            nxt = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / steps


def without_checks():
    """Patch out the checks the contract layer added (the pre-existing selection checks stay)."""
    return [mock.patch("polykv.contract.rules.checked_scores", lambda rule, scores, ctx: scores),
            mock.patch.object(contract_checks.StoreContract, "after", lambda self, call, storage, keys=None: None),
            mock.patch.object(contract_checks.StoreContract, "read", lambda self, stream, x, *a, **k: x),
            mock.patch.object(contract_checks.StoreContract, "written", lambda self, s, st, m, cost: cost)]


def time_inside_checks(model, plan, ids, steps: int, check: bool) -> tuple[float, float]:
    """(seconds inside the contract checks per decode step, seconds per step), timing each check call."""
    spent = [0.0]
    targets = [(polykv.contract.rules, "checked_scores"), (contract_checks.StoreContract, "after"),
               (contract_checks.StoreContract, "read"), (contract_checks.StoreContract, "written")]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    patches = [mock.patch.object(owner, name, timed(getattr(owner, name))) for owner, name in targets]
    for p in patches:
        p.start()
    try:
        with torch.no_grad(), polykv.apply(model, plan, check=check) as session:
            cache = session.new_cache()
            out = model(ids, use_cache=True, **{session.cache_keyword: cache})
            nxt = out.logits[:, -1:].argmax(-1)
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                out = model(nxt, use_cache=True, **{session.cache_keyword: cache})
                nxt = out.logits[:, -1:].argmax(-1)
            return spent[0] / steps, (time.perf_counter() - start) / steps
    finally:
        for p in patches:
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-model", action="store_true", help="SmolLM2-135M instead of a tiny random model")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.default_model:
        from polykv.models import load_default_model

        model = load_default_model()[0]
    else:
        model = tiny_model("llama", layers=8, heads=8, kv_heads=4, head_dim=64, vocab=512)
    geo = geometry_of_model(model)
    cap = args.context // 2
    layers = [{"prefill": OpSpec(rule="key-norm", capacity=cap), "decode": OpSpec(rule="key-norm", capacity=cap),
               **({"k_bits": 4, "v_bits": 4} if i < geo.num_layers // 2 else {})} for i in range(geo.num_layers)]
    plan = per_layer_plan(geo, layers, decode_slack=1)
    ids = torch.randint(1, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    times = {"none": [], "cheap": [], "full": []}
    decode_seconds(model, plan, ids, 2, False)  # warm-up
    for _ in range(args.rounds):
        patches = without_checks()
        for p in patches:
            p.start()
        try:
            times["none"].append(decode_seconds(model, plan, ids, args.steps, False))
        finally:
            for p in patches:
                p.stop()
        times["cheap"].append(decode_seconds(model, plan, ids, args.steps, False))
        times["full"].append(decode_seconds(model, plan, ids, args.steps, True))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {'SmolLM2-135M' if args.default_model else 'tiny llama 8x(8/4 heads, d64)'}, context "
          f"{args.context}, {args.steps} decode steps x {args.rounds} rounds, threads {torch.get_num_threads()}")
    for k in ("none", "cheap", "full"):
        print(f"{k:>5}: {med[k] * 1e3:8.3f} ms/step  ratio {med[k] / med['none']:.3f}")
    for label, check in (("cheap", False), ("full", True)):
        inside, step = time_inside_checks(model, plan, ids, args.steps, check)
        print(f"{label:>5}: {inside * 1e6:8.1f} us/step inside the checks = {inside / step:.2%} of a "
              f"{step * 1e3:.3f} ms step")


if __name__ == "__main__":
    main()
