"""Decode speed of KIVI-quantized plans against vanilla at long context, as ratios measured in the same run.

Configurations, every one on the same prompt (random token ids) after one prefill:

* ``vanilla``: the model with its own attention and a transformers ``DynamicCache``;
* ``full-16``: a polykv plan that keeps every token at 16 bits: the runtime's own per-step cost against vanilla,
  with nothing compressed (what a quantized plan gains or loses beyond it is the quantizer's);
* ``evict-8x``: 16-bit keys and values, ``--rule`` (default streamingllm) keeping context / 8 tokens;
* ``k4v4``: every token kept, keys and values at 4 bits (KIVI, group 32, residual 32);
* ``k4v4-evict-8x``: the 8x eviction plan with 4-bit keys and values;
* ``k4v4-blockwise``: ``k4v4`` with the compiled CPU kernel switched off (``POLYKV_KIVI_CPU_KERNEL=0``): the
  blockwise torch read of the codes, for comparison (only when named in ``--only``).

Each configuration decodes ``--steps`` greedy tokens one forward at a time, ``--rounds`` times after its
prefill (the best round counts; every round is printed, so a busy machine's noise shows), and the whole list
is run ``--repeats`` times in turn, each pass printing its rows with ratios against that pass's vanilla. The
load average (``uptime``) is printed before and after. Quantized layers decode through the compiled CPU kernel
over the codes (``polykv.adapters.quantizers.kivi_cpu``); ``POLYKV_KIVI_CPU_KERNEL=0`` measures the blockwise
torch path instead.

    OMP_NUM_THREADS=2 nice -n 5 python bench/quantized_decode.py               # SmolLM2-135M, 4096 and 8000
    OMP_NUM_THREADS=2 nice -n 5 python bench/quantized_decode.py --tiny --contexts 1024 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

import polykv
from polykv.adapters.quantizers import kivi_cpu
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.runtime.cache import cache_keyword, output_cache

KIVI = {"group_size": 32, "residual": 32}
CONFIGS = ("vanilla", "full-16", "evict-8x", "k4v4", "k4v4-evict-8x", "k4v4-blockwise")
DEFAULT = CONFIGS[:5]


def plans(geo, context: int, rule: str) -> dict:
    """The plan of every configuration (None: vanilla)."""
    op = OpSpec(rule=rule, capacity=max(1, context // 8))
    decodes = "decode" in polykv.get_registry().rule(rule).phases
    evict = {"prefill": op, "decode": op if decodes else None, "decode_slack": 16}
    return {"vanilla": None,
            "full-16": polykv.uniform_plan(geo),
            "evict-8x": polykv.uniform_plan(geo, **evict),
            "k4v4": polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=KIVI),
            "k4v4-evict-8x": polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=KIVI, **evict),
            "k4v4-blockwise": polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=KIVI)}


def decode_speed(model, ids, plan, steps: int, rounds: int) -> tuple[list[float], int]:
    """(tokens/s of each of ``rounds`` rounds of ``steps`` greedy one-token forwards after one prefill, resident
    K/V bytes after the last round)."""
    with torch.no_grad():
        session = None
        if plan is None:
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = output_cache(out)
        else:
            session = polykv.apply(model, plan).__enter__()
            out = session.prefill(ids, logits_to_keep=1)
            cache = session.cache
        tok, speeds = out.logits[:, -1:].argmax(-1), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            speeds.append(steps / (time.perf_counter() - t0))
        if session is None:
            kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                     if t is not None)
        else:
            kv = session.resident_bytes().total
            session.__exit__(None, None, None)
    return speeds, kv


@contextlib.contextmanager
def kernel_switch(on: bool):
    """``POLYKV_KIVI_CPU_KERNEL=0`` inside the block unless ``on`` (the setting outside it is kept)."""
    before = os.environ.get(kivi_cpu.ENV_SWITCH)
    if not on:
        os.environ[kivi_cpu.ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(kivi_cpu.ENV_SWITCH, None)
        else:
            os.environ[kivi_cpu.ENV_SWITCH] = before


def load(tiny: bool):
    if tiny:
        from polykv.testing import tiny_model

        return tiny_model("llama", layers=4, heads=9, kv_heads=3, head_dim=64, vocab=512, attn_implementation="sdpa")
    from polykv.models import load_default_model

    return load_default_model()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8000])
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after each prefill (the best counts)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over every configuration, each with its ratios")
    ap.add_argument("--rule", default="streamingllm", help="the retention rule of the 8x plans")
    ap.add_argument("--only", nargs="+", choices=CONFIGS, default=None, help="configurations to run")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = load(args.tiny).eval()
    geo = geometry_of_model(model)
    names = [n for n in CONFIGS if (n in args.only if args.only else n in DEFAULT) or n == "vanilla"]
    print(f"# {type(model).__name__}: {geo.num_layers} layers, {geo.num_heads} heads, {geo.num_kv_heads} KV heads, "
          f"d={geo.head_dim}; float32, {torch.get_num_threads()} threads; {args.steps} steps x {args.rounds} rounds "
          f"x {args.repeats} repeats; 8x rule {args.rule}; CPU kernel "
          f"{'on' if kivi_cpu.enabled() else 'off'}")
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    warm = torch.randint(1, vocab, (1, 64), generator=g)
    for name, plan in plans(geo, 64, args.rule).items():  # warm-up (builds the CPU kernel), not reported
        if name in names:
            decode_speed(model, warm, plan, 2, 1)
    print(f"{'config':<16}{'ctx':>6}{'tok/s':>9}{'x vanilla':>11}   {'every round (tok/s)':<32}{'KV MiB':>9}")
    for context in args.contexts:
        ids = torch.randint(1, vocab, (1, context), generator=g)
        todo = {n: p for n, p in plans(geo, context, args.rule).items() if n in names}
        for rep in range(args.repeats):
            base = None
            for name, plan in todo.items():
                with kernel_switch(not name.endswith("-blockwise")):
                    speeds, kv = decode_speed(model, ids, plan, args.steps, args.rounds)
                best = max(speeds)
                base = base or best
                rounds = " ".join(f"{s:.2f}" for s in speeds)
                print(f"{name:<16}{context:>6}{best:>9.2f}{best / base:>11.2f}   {rounds:<32}{kv / 2 ** 20:>9.2f}",
                      flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
