"""Decode-attention benchmark: attention straight from KIVI codes vs dequantize-then-SDPA, one layer.

For each context length and K/V bit mix, one layer's stores are filled with random keys and values
(the geometry of SmolLM2-135M by default: 9 query heads, 3 KV heads, head dim 64), and one decode
query attends over them in three ways, timed in the same run (best of ``--reps``, interleaved):

* ``dense``: ``dequantize()`` both stores, then SDPA (what the runtime does today every step);
* ``blockwise``: :func:`polykv.attention.online_softmax.blockwise_attention` over the stores' token blocks
  (dequantize one block, attend, combine with an online softmax; never a full-precision copy);
* the Triton kernel's agreement with the blockwise reference (on CPU it runs in Triton's
  interpreter, so it is checked, not timed, at ``--kernel-tokens``);
* on CPU, the compiled C kernel (:mod:`polykv.adapters.quantizers.kivi_cpu`, what a CPU decode runs) against
  SDPA over a float32 cache of the same tokens (what vanilla attention reads), timed the same way, with its
  agreement.

    python bench/attention_kernels.py                          # 2k, 4k and 16k tokens, K4V4 and K2V2, CPU
    python bench/attention_kernels.py --contexts 2048 --bits 4/4 --threads 2
    python bench/attention_kernels.py --contexts 8000 --bits 4/4 --reps 30    # the CPU kernel at 8k, one thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton builds its kernels

import torch.nn.functional as F  # noqa: E402

from polykv.adapters.quantizers import kivi_cpu  # noqa: E402
from polykv.adapters.quantizers.kivi import KiviQuantizer  # noqa: E402
from polykv.attention.online_softmax import blockwise_attention, token_blocks  # noqa: E402


def filled_stores(T, k_bits, v_bits, *, kv_heads, head_dim, dtype, device, seed=0):
    quant = KiviQuantizer(group_size=32, residual=32)
    g = torch.Generator().manual_seed(seed)
    ks = quant.new_store("key", k_bits, dtype=dtype, device=device)
    vs = quant.new_store("value", v_bits, dtype=dtype, device=device)
    for a in range(0, T, 1024):
        n = min(1024, T - a)
        ks.append(torch.randn(1, kv_heads, n, head_dim, generator=g).to(device, dtype))
        vs.append(torch.randn(1, kv_heads, n, head_dim, generator=g).to(device, dtype))
    return ks, vs


def dense_decode(query, ks, vs, scaling):
    """The runtime's current decode: materialise both streams, fold GQA into the query axis, SDPA."""
    B, H, _, d = query.shape
    K, V = ks.dequantize(), vs.dequantize()
    Hkv = K.shape[1]
    out = F.scaled_dot_product_attention(query.view(B, Hkv, H // Hkv, d), K, V, scale=scaling)
    return out.view(B, H, 1, d)


def timed(fns, reps, sync):
    """Best-of-``reps`` (wall, process CPU) seconds of each function, runs interleaved.

    Process CPU time is the steadier figure on a busy machine (waiting for a core is not counted);
    with one thread it is the work done.
    """
    for fn in fns:
        fn()  # warm-up
    best = [[float("inf"), float("inf")] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            best[i][0] = min(best[i][0], time.perf_counter() - t0)
            best[i][1] = min(best[i][1], time.process_time() - c0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 16384])
    ap.add_argument("--bits", nargs="+", default=["4/4", "2/2"], help="K/V bit widths, e.g. 4/4 2/8 16/4")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=1024, help="tokens per block of the blockwise reference")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: CPU time = work done)")
    ap.add_argument("--kernel-tokens", type=int, default=1024, help="context of the kernel agreement check on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    scaling = args.head_dim ** -0.5
    print(f"decode attention, one layer: {args.heads} heads / {args.kv_heads} KV heads, d={args.head_dim}, "
          f"{dtype}, {device}, {args.threads} threads, block {args.block}, best of {args.reps}")
    print("# ms = best wall time; cpu = best process CPU time; ratio = dense / blockwise (> 1: blockwise faster)")
    print(f"{'K/V bits':>8} {'tokens':>7} {'dense ms':>9} {'cpu':>7} {'blockwise ms':>13} {'cpu':>7} "
          f"{'ratio':>6} {'cpu':>6} {'max |diff|':>11}")
    for bits in args.bits:
        kb, vb = (int(x) for x in bits.split("/"))
        for T in args.contexts:
            ks, vs = filled_stores(T, kb, vb, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype,
                                   device=device)
            q = torch.randn(1, args.heads, 1, args.head_dim, generator=torch.Generator().manual_seed(1))
            q = q.to(device, dtype)
            kv, vv = token_blocks(ks), token_blocks(vs)
            dense, block = timed([lambda: dense_decode(q, ks, vs, scaling),
                                  lambda: blockwise_attention(q, kv, vv, scaling=scaling, block_size=args.block)],
                                 args.reps, sync)
            diff = (dense_decode(q, ks, vs, scaling).float()
                    - blockwise_attention(q, kv, vv, scaling=scaling, block_size=args.block).float()).abs().max()
            print(f"{bits:>8} {T:>7} {dense[0] * 1e3:>9.2f} {dense[1] * 1e3:>7.2f} {block[0] * 1e3:>13.2f} "
                  f"{block[1] * 1e3:>7.2f} {dense[0] / block[0]:>6.2f} {dense[1] / block[1]:>6.2f} {diff.item():>11.2e}")
    if device.type == "cpu":
        cpu_kernel_speed(args, scaling)
    kernel_agreement(args, device, dtype, scaling, sync)
    return 0


def cpu_kernel_speed(args, scaling) -> None:
    """The compiled CPU kernel over the codes against SDPA over a float32 cache holding the same tokens."""
    if kivi_cpu.library() is None:
        print("CPU kernel: not built here (see the warning above); not timed")
        return
    print("CPU kernel over the codes vs SDPA over a float32 cache of the same tokens (ratio > 1: kernel faster):")
    print(f"{'K/V bits':>8} {'tokens':>7} {'SDPA ms':>8} {'cpu':>7} {'kernel ms':>10} {'cpu':>7} {'ratio':>6} "
          f"{'cpu':>6} {'max |diff|':>11}")
    for bits in args.bits:
        kb, vb = (int(x) for x in bits.split("/"))
        for T in args.contexts:
            ks, vs = filled_stores(T, kb, vb, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=torch.float32,
                                   device="cpu")
            q = torch.randn(1, args.heads, 1, args.head_dim, generator=torch.Generator().manual_seed(1))
            kv, vv = token_blocks(ks), token_blocks(vs)
            K, V = ks.dequantize(), vs.dequantize()
            qv = q.view(1, args.kv_heads, args.heads // args.kv_heads, args.head_dim)
            sdpa, kernel = timed([lambda: F.scaled_dot_product_attention(qv, K, V, scale=scaling),
                                  lambda: kivi_cpu.decode_attention(q, kv, vv, scaling=scaling)], args.reps,
                                 lambda: None)
            diff = (kivi_cpu.decode_attention(q, kv, vv, scaling=scaling)
                    - F.scaled_dot_product_attention(qv, K, V, scale=scaling).view_as(q)).abs().max()
            print(f"{bits:>8} {T:>7} {sdpa[0] * 1e3:>8.3f} {sdpa[1] * 1e3:>7.3f} {kernel[0] * 1e3:>10.3f} "
                  f"{kernel[1] * 1e3:>7.3f} {sdpa[0] / kernel[0]:>6.2f} {sdpa[1] / kernel[1]:>6.2f} "
                  f"{diff.item():>11.2e}")


def kernel_agreement(args, device, dtype, scaling, sync) -> None:
    try:
        from polykv.adapters.quantizers import kivi_triton
    except ImportError:
        print("kernel: Triton is not installed (pip install -e '.[kernels]'); agreement not checked")
        return
    T = args.kernel_tokens if device.type == "cpu" else max(args.contexts)
    mode = "interpreter (TRITON_INTERPRET=1)" if kivi_triton.interpreting() else "compiled"
    print(f"Triton kernel vs blockwise reference, {T} tokens, {mode}:")
    for bits in args.bits:
        kb, vb = (int(x) for x in bits.split("/"))
        ks, vs = filled_stores(T, kb, vb, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device)
        q = torch.randn(1, args.heads, 1, args.head_dim, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        kv, vv = token_blocks(ks), token_blocks(vs)
        t0 = time.perf_counter()
        got = kivi_triton.decode_attention(q, kv, vv, scaling=scaling)
        sync()
        took = time.perf_counter() - t0
        ref = blockwise_attention(q, kv, vv, scaling=scaling, block_size=args.block)
        diff = (got.float() - ref.float()).abs().max().item()
        line = f"  K{kb}V{vb}: max |kernel - reference| = {diff:.2e} (first call {took:.2f} s)"
        if device.type == "cuda":
            K, V = ks.dequantize(), vs.dequantize()
            B, H, _, d = q.shape
            qv = q.view(B, args.kv_heads, H // args.kv_heads, d)
            kernel, sdpa = timed([lambda: kivi_triton.decode_attention(q, kv, vv, scaling=scaling),
                                  lambda: F.scaled_dot_product_attention(qv, K, V, scale=scaling)], args.reps, sync)
            line += (f"; kernel {kernel[0] * 1e3:.3f} ms vs SDPA over the same keys {sdpa[0] * 1e3:.3f} ms "
                     f"({kernel[0] / sdpa[0]:.2f}x)")
        print(line)


if __name__ == "__main__":
    sys.exit(main())
