"""Ada-KV's head-wise budgets on the default model: real ragged memory, equal to the prediction.

Prefills one passkey prompt under two plans at the same budget — ``adakv`` (head-wise budgets around
SnapKV) and ``snapkv`` (every KV head keeps the same count) — feeds the question and generates, and
prints per plan: resident K/V bytes after prefill next to the memory model's prediction from the
cache's per-head counts, how many layers hold different counts per KV head, and the peak resident
bytes (K/V + metadata) over prefill and every decode step. Usage::

    python bench/adakv_memory.py [--length 2048] [--ratio 8] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.runtime.cache import cache_keyword
from polykv.memory import predict_resident
from polykv.models import load_default_model
from polykv.plan import OpSpec
from polykv.registry import get_registry


def measure(model, tok, plan, context: str, question: str, new_tokens: int) -> dict:
    geo = geometry_of_model(model)
    ids = tok(context, return_tensors="pt", add_special_tokens=False).input_ids
    q = tok(question, return_tensors="pt", add_special_tokens=False).input_ids
    T = ids.shape[1]
    dtype_bytes = next(model.parameters()).element_size()
    peak = 0
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        model(ids, **{cache_keyword(model): cache}, use_cache=True)
        rb = session.resident_bytes()
        counts = cache.head_counts()
        rows = predict_resident(plan, geo, T, dtype_bytes=dtype_bytes, head_counts=counts)
        after_prefill = (rb.total, sum(r.resident_bytes for r in rows), rb.metadata_total,
                         sum(r.metadata_bytes for r in rows))
        peak = rb.total + rb.metadata_total
        out = model(q, **{cache_keyword(model): cache}, use_cache=True)
        text = []
        for _ in range(new_tokens):
            rb = session.resident_bytes()
            peak = max(peak, rb.total + rb.metadata_total)
            nxt = out.logits[:, -1:].argmax(-1)
            text.append(int(nxt))
            out = model(nxt, **{cache_keyword(model): cache}, use_cache=True)
        rb = session.resident_bytes()
        peak = max(peak, rb.total + rb.metadata_total)
    ragged = sum(1 for layer in counts if len({n for row in layer for n in row}) > 1)
    return {"tokens": T, "resident": after_prefill[0], "predicted": after_prefill[1], "metadata": after_prefill[2],
            "predicted_metadata": after_prefill[3], "ragged_layers": ragged, "layer0_counts": counts[0][0],
            "peak": peak, "answer": tok.decode(text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=8.0)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    geo = geometry_of_model(model)
    item = get_registry().task("passkey")().make_items(tok, 1, seed=0, length=args.length)[0]
    random.seed(0)
    plans = {"adakv": polykv.uniform_plan(geo, prefill=OpSpec(rule="adakv", capacity_ratio=1 / args.ratio)),
             "snapkv": polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity_ratio=1 / args.ratio))}
    print(f"passkey item 0, key {item.answers[0]}, {args.ratio:g}x, SmolLM2-135M-Instruct float32")
    print("| plan | prompt tokens | resident K/V bytes | predicted | metadata | predicted metadata | layers with "
          "differing head counts | layer 0 counts per KV head | peak bytes (K/V + metadata) | answer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    res = {}
    for name, plan in plans.items():
        r = res[name] = measure(model, tok, plan, item.context, item.question, args.new_tokens)
        print(f"| {name} | {r['tokens']} | {r['resident']} | {r['predicted']} | {r['metadata']} | "
              f"{r['predicted_metadata']} | {r['ragged_layers']}/{geo.num_layers} | {r['layer0_counts']} | "
              f"{r['peak']} | {r['answer'].strip()[:20]!r} |")
    ok = (res["adakv"]["resident"] == res["adakv"]["predicted"] and res["adakv"]["ragged_layers"] > 0
          and res["adakv"]["peak"] <= res["snapkv"]["peak"])
    print("adakv: resident == predicted, ragged heads, peak <= uniform-head peak:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
