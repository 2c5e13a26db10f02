"""Decode speed of a low-rank plan against the same plan at full rank, on the default model, in one run.

Both plans keep every token at the same bit widths; the rank plan stores every layer's keys and values
as codes of ``--rank`` channels (default d/2) on the model's offline bases and attends in code space.
After one prefill of ``--context`` tokens (filler prose from the offline corpus) each plan decodes
``--steps`` greedy tokens one forward at a time; the two are timed alternately, ``--rounds`` times each,
and the best round counts. Printed: tokens/s of each, the ratio (rank / full; target >= 1.0: the codes
are smaller), the resident K/V bytes of each right after prefill with the memory model's prediction, the
bases' bytes, and how many greedy tokens agree.

    OMP_NUM_THREADS=1 python bench/rank_decode.py              # SmolLM2-135M, 4k context, rank 32 of 64
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

import polykv
from polykv.models import load_default_model
from polykv.models.corpus import filler_text
from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KV_BASES_KEY


def decode(model, plan, ids, steps: int, bases):
    """(seconds for ``steps`` one-token forwards after the prefill, the greedy tokens, resident bytes right after
    prefill, and their prediction by the memory model)."""
    from polykv.memory import predict_resident

    with torch.no_grad(), polykv.apply(model, plan, model_data={KV_BASES_KEY: bases}) as session:
        out = session.prefill(ids)
        resident = session.resident_bytes()
        predicted = sum(r.resident_bytes for r in predict_resident(plan, session.geometry, ids.shape[1],
                                                                   dtype_bytes=out.logits.element_size()))
        kw = {session.cache_keyword: session.cache}
        tok, tokens = out.logits[:, -1:].argmax(-1), []
        start = time.perf_counter()
        for _ in range(steps):
            out = model(tok, use_cache=True, **kw)
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
        seconds = time.perf_counter() - start
        return seconds, tokens, resident, predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None, help="channels of the key and value codes (default d/2)")
    ap.add_argument("--bits", type=int, default=16, help="K and V bits of both plans (16, 8, 4, 2)")
    args = ap.parse_args()

    model, tok = load_default_model()
    geo = geometry_of_model(model)
    rank = args.rank or geo.head_dim // 2
    text = filler_text(6 * args.context, kind="prose", seed=0)
    ids = tok(text, return_tensors="pt").input_ids[:, :args.context]
    full = polykv.uniform_plan(geo, k_bits=args.bits, v_bits=args.bits)
    ranked = attrs.evolve(full, layers=[attrs.evolve(lp, k_rank=rank, v_rank=rank) for lp in full.layers])
    t0 = time.perf_counter()
    bases = polykv.apply(model, ranked, tokenizer=tok).model_data[KV_BASES_KEY]  # found in the cache, or computed
    print(f"model {geo.model_type}: {geo.num_layers} layers, {geo.num_kv_heads} KV heads, head dim {geo.head_dim}; "
          f"context {ids.shape[1]} tokens, {args.steps} decode steps, {args.bits}-bit K/V, rank {rank} for K and V "
          f"(bases ready in {time.perf_counter() - t0:.1f} s, measured over {bases.num_tokens} tokens)")
    best = {"full": float("inf"), "rank": float("inf")}
    seen = {}
    for _ in range(args.rounds):
        for name, plan in (("full", full), ("rank", ranked)):
            seconds, tokens, resident, predicted = decode(model, plan, ids, args.steps, bases)
            best[name] = min(best[name], seconds)
            seen[name] = (tokens, resident, predicted)
    for name in ("full", "rank"):
        tokens, resident, predicted = seen[name]
        label = "full-rank plan" if name == "full" else f"rank-{rank} plan"
        print(f"{label:>14}: {args.steps / best[name]:6.2f} tok/s decode   resident K/V after prefill "
              f"{resident.total:,} B (predicted {predicted:,} B)"
              + (f"   bases {resident.bases:,} B (once per model)" if resident.bases else ""))
    agree = sum(a == b for a, b in zip(seen["full"][0], seen["rank"][0]))
    print(f"ratio rank / full decode speed: {best['full'] / best['rank']:.3f}x (target >= 1.0)   "
          f"K/V bytes {seen['rank'][1].total / seen['full'][1].total:.3f}x   "
          f"greedy tokens equal to full rank: {agree}/{args.steps}")


if __name__ == "__main__":
    main()
