"""Cost of one decode append to a KIVI store: preallocated buffers against exact-size tensors.

A store the runtime has asked to ``reserve`` writes a decode token's codes into free rows (growing its
buffers a GROWTH_BLOCK of rows at a time); a store never asked keeps exactly-sized tensors, so every
append that quantizes copies the whole quantized part (what the stores did before they preallocated).
Both stores get the same prompt and the same tokens, in the same process; the script checks that they
dequantize to the same values and prints the time per append and the ratio.

    python bench/kivi_append.py                                  # SmolLM2's layer shape, 1k / 4k / 16k tokens
    python bench/kivi_append.py --contexts 4096 --steps 256 --bits 2
"""

from __future__ import annotations

import argparse
import time

import torch

from polykv.registry import get_registry


def time_appends(store, tokens: torch.Tensor) -> float:
    """Seconds per one-token append of ``tokens`` [B, Hkv, n, d]."""
    start = time.perf_counter()
    for t in range(tokens.shape[2]):
        store.append(tokens[:, :, t:t + 1])
    return (time.perf_counter() - start) / tokens.shape[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=128, help="decode appends timed per store")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kivi = get_registry().quantizer("kivi")()
    gen = torch.Generator().manual_seed(0)
    print(f"KIVI {args.bits}-bit, group 32, residual 32, [1, {args.kv_heads}, T, {args.head_dim}] float32, "
          f"{args.steps} one-token appends after a T-token prompt, {args.threads} threads")
    print(f"{'T':>6} {'stream':>6} {'exact-size ms':>14} {'preallocated ms':>16} {'ratio':>6}")
    for T in args.contexts:
        x = torch.randn(1, args.kv_heads, T + args.steps, args.head_dim, generator=gen)
        for stream in ("key", "value"):
            exact = kivi.new_store(stream, args.bits, dtype=torch.float32, device="cpu")
            reserved = kivi.new_store(stream, args.bits, dtype=torch.float32, device="cpu")
            reserved.reserve(T)  # the runtime's reserve for a layer that keeps everything
            for store in (exact, reserved):
                store.append(x[:, :, :T])
            t_exact = time_appends(exact, x[:, :, T:])
            t_reserved = time_appends(reserved, x[:, :, T:])
            if not torch.equal(exact.dequantize(), reserved.dequantize()):
                raise SystemExit(f"T={T} {stream}: the two stores disagree")
            print(f"{T:>6} {stream:>6} {t_exact * 1e3:>14.4f} {t_reserved * 1e3:>16.4f} {t_exact / t_reserved:>6.2f}")


if __name__ == "__main__":
    main()
