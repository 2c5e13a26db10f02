"""One layer's prefill attention with H2O's column sums: plain SDPA, SDPA then the generic chunked
recompute (what a state declaring nothing gets), and the one-pass ``attention_with_signals``.

Random post-RoPE tensors of the default model's geometry (9 query heads, 3 KV heads, d = 64),
float32 on CPU; best of ``--repeats`` runs in process CPU time (steady on a busy machine) and wall
time, as ratios to SDPA:

    python bench/attention_signals.py                       # 2k and 4k tokens, 1 thread
    python bench/attention_signals.py --contexts 8192 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from polykv.attention.signals import SignalRequest, attention_column_sums, attention_with_signals
from polykv.attention.kernels import sdpa


def best(fn, repeats: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds), the best of ``repeats`` runs each."""
    cpu = wall = float("inf")
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return cpu, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "HKV", "D"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    H, Hkv, d = args.heads
    request = SignalRequest(column_sums=True)
    print(f"# {H} query heads, {Hkv} KV heads, d={d}, float32, {args.threads} thread(s); best of {args.repeats}")
    print(f"{'ctx':>6}{'SDPA ms':>9}{'+generic':>10}{'x':>6}{'one pass':>10}{'x':>6}{'x wall':>8}")
    with torch.no_grad():
        for T in args.contexts:
            g = torch.Generator().manual_seed(T)
            q, k, v = (torch.randn(1, n, T, d, generator=g) for n in (H, Hkv, Hkv))
            scale = d ** -0.5
            base = best(lambda: sdpa(q, k, v, scale), args.repeats)
            generic = best(lambda: (sdpa(q, k, v, scale), attention_column_sums(q, k, scale)), args.repeats)
            fused = best(lambda: attention_with_signals(q, k, v, scale, request), args.repeats)
            print(f"{T:>6}{base[0] * 1e3:>9.0f}{generic[0] * 1e3:>10.0f}{generic[0] / base[0]:>6.2f}"
                  f"{fused[0] * 1e3:>10.0f}{fused[0] / base[0]:>6.2f}{fused[1] / base[1]:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
