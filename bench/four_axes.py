"""A plan over all four axes of the KV cache on the default model, from calibration to generation, in one run.

1. Calibrate a small four-axis profile of SmolLM2-135M (``--sequences`` of ``--tokens`` tokens, the first
   ``--prefix`` compressed; rules ``--rules`` at ``--keeps``, widths ``--bits``, ranks d, 3d/4, d/2, d/4 for keys
   and values, every adjacent layer pair; l2 metric only, no held-out sequences): what
   ``polykv calibrate default --ranks d,3d/4,d/2,d/4 --pairs --validate 0`` measures.
2. Solve it with ``exact`` at each of ``--budgets`` (resident bytes at ``--context`` tokens) and report which
   axes each plan uses. When no solved plan shares a pair (the pair errors are large next to the rest of the
   table), the plan shown is the solved plan at ``--budget`` with its cheapest-to-share pair (lowest pair loss)
   set to share by hand, built with :func:`polykv.per_layer_plan`, and the script says so.
3. ``polykv plan show`` of that plan, a 64-token greedy generation under it, and its resident K/V bytes right
   after prefill against the memory model's prediction (:func:`polykv.memory.predict_resident`).

    OMP_NUM_THREADS=1 python bench/four_axes.py

Measured 2026-12-02 on 2 CPU cores (whole output: ``bench/results/four_axes-2026-12-02.txt``, 166 s): the
profile has 96 configs (88 low-rank) and 29 pairs; ``exact`` routes tokens and bits alone at 3x-8x and adds rank
32 (and 16 on layer 0) at 9x; it never shares a pair (pair losses 0.94-2.34), so pair 9-10 is shared by hand;
resident K/V after prefill measured 2,749,056 B = the memory model's 2,749,056 B (every layer equal), bases
221,184 B apart; the 64 greedy tokens agree with vanilla on 4.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import attrs
import numpy as np
import torch

import polykv
from polykv.errors import SolverError
from polykv.memory import full_cache_bytes_16bit, predict_resident
from polykv.models import load_default_model
from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan import FULL_OP
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import CalibrationSettings, corpus_sequences
from polykv.profiling.rank_error import rank_candidates
from polykv.solvers import solve


def by_hand(plan, profile, geo):
    """``plan`` completed by hand to use every axis: when it shares no pair, the pair of lowest measured loss is
    shared (both layers full, 16 bits, full rank); when it has no rank, the unshared layer of lowest measured
    ``K32V32`` rank error stores keys and values at rank 32 (d/2). Returns the plan and what was changed."""
    layers, changes = list(plan.layers), []
    pairs = profile.pairs
    if not plan.share_pairs():
        upper = int(pairs.uppers[int(np.argmin(pairs.loss))])
        for i in (upper - 1, upper):
            layers[i] = attrs.evolve(layers[i], prefill=FULL_OP, decode=FULL_OP, k_bits=16, v_bits=16, k_rank=None,
                                     v_rank=None, share=upper - 1 if i == upper else None,
                                     share_params=dict(pairs.share_params) if i == upper else {})
        changes.append(f"pair {upper - 1}-{upper} shared (lowest pair loss {float(pairs.loss.min()):.3f})")
    if not plan.low_rank:
        stat = profile.stats["rank_l2"]
        col = stat.values[:, stat.columns.index("K32V32")]
        paired = {x for lp in layers if lp.share is not None for x in (lp.share, lp.layer)}
        layer = min((i for i in range(len(layers)) if i not in paired), key=lambda i: col[i])
        layers[layer] = attrs.evolve(layers[layer], k_rank=32, v_rank=32)
        changes.append(f"layer {layer} at rank 32 for K and V (lowest K32V32 rank error {col[layer]:.3f})")
    if not changes:
        return plan, changes
    prov = attrs.evolve(plan.provenance, solver=None, note=f"by hand: the exact plan ({plan.provenance.solver}, "
                        f"{plan.provenance.budget}) with " + "; ".join(changes), predicted_loss=None,
                        predicted_bytes=None)
    out = polykv.per_layer_plan(geo, layers, decode_slack=plan.trigger.decode_slack, provenance=prov)
    return attrs.evolve(out, model_data=dict(plan.model_data)), changes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rules", default="snapkv")
    ap.add_argument("--keeps", default="0.25,1.0")
    ap.add_argument("--bits", default="16,4")
    ap.add_argument("--context", type=int, default=640, help="context of the budgets and of the generation prompt")
    ap.add_argument("--budgets", default="3x,4x,6x,8x,9x")
    ap.add_argument("--budget", default="4x", help="the budget of the plan shown when several use as many axes")
    ap.add_argument("--profile", default=None, help="reuse this profile (and its bases beside it) when it exists, "
                    "else save the calibrated one there")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, tok = load_default_model()
    geo = geometry_of_model(model)
    ranks = tuple(None if r == geo.head_dim else r for r in rank_candidates(geo.head_dim))
    settings = CalibrationSettings(rules=args.rules.split(","), keeps=tuple(float(k) for k in args.keeps.split(",")),
                                   bits=tuple(int(b) for b in args.bits.split(",")), prefix=args.prefix,
                                   ranks=ranks, pairs=True)
    tokenize = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, corpus = corpus_sequences(tokenize, args.sequences, args.tokens, seed=0)
    from polykv.models.kv_bases import KV_BASES_SUFFIX, KVBases
    from polykv.contract.model_data import side_file
    from polykv.profiling.profile import load_profile

    if args.profile and os.path.isfile(args.profile):
        prof, seconds = load_profile(args.profile), 0.0
        bases = KVBases.load(side_file(args.profile, KV_BASES_SUFFIX))
    else:
        result = calibrate(model, seqs, settings, corpus=corpus)
        prof, bases, seconds = result.profile, result.model_data[KV_BASES_KEY], result.seconds
        if args.profile:
            prof.save(args.profile)
            bases.save(side_file(args.profile, KV_BASES_SUFFIX))
    print(f"model {geo.model_type}: {geo.num_layers} layers, {geo.num_kv_heads} KV heads, head dim {geo.head_dim}")
    print(f"profile: {len(prof.configs)} configs ({sum(c.low_rank for c in prof.configs)} low-rank), axes "
          f"{', '.join(prof.axes)}, {len(prof.pairs.uppers)} pairs, calibrated in {seconds:.0f} s")
    print(f"  ranks {['d' if r is None else r for r in ranks]}; note: {prof.provenance.note}")
    rank_l2 = prof.stats["rank_l2"]
    for j, col in enumerate(rank_l2.columns):
        v = rank_l2.values[:, j]
        print(f"  rank_l2 {col:>8}: min {v.min():.4f} median {np.median(v):.4f} max {v.max():.4f} over layers")
    loss = prof.pairs.loss
    print(f"  pair loss (lower + upper l2): min {loss.min():.3f} (pair {prof.pairs.uppers[int(loss.argmin())] - 1}-"
          f"{prof.pairs.uppers[int(loss.argmin())]}) median {np.median(loss):.3f} max {loss.max():.3f}")

    solved = {}
    for b in args.budgets.split(","):
        budget = Budget.parse(b, args.context, basis="resident")
        try:
            plan = solve(prof, budget, "exact")
        except SolverError as exc:
            print(f"exact at {budget.describe()}: infeasible ({exc})")
            continue
        solved[b] = plan
        print(f"exact at {budget.describe()}: predicted l2 loss {plan.provenance.predicted_loss:.3f}, "
              f"{plan.provenance.predicted_bytes:,} B; uses axes {', '.join(plan.axes_used())}")
    name = max(solved, key=lambda b: (len(solved[b].axes_used()), b == args.budget))
    plan, changes = by_hand(solved[name], prof, geo)
    if changes:
        print(f"the solved plans do not use every axis (their measured errors are large next to eviction and bits "
              f"per byte saved): the plan shown is the exact plan at {name} changed BY HAND (per_layer_plan): "
              + "; ".join(changes))
    else:
        print(f"the plan shown is the exact plan at {name}, as solved")
    print(f"plan shown uses axes: {', '.join(plan.axes_used())}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "four_axes.plan.json")
        plan.save(path)
        show = subprocess.run([sys.executable, "-m", "polykv", "plan", "show", path, "--context", str(args.context)],
                              capture_output=True, text=True)
        print(f"\n$ polykv plan show four_axes.plan.json --context {args.context}")
        print(show.stdout.rstrip() or show.stderr.rstrip())

    prompt = corpus_sequences(tokenize, args.sequences + 1, args.context, seed=0)[0][-1].view(1, -1)
    with torch.no_grad(), polykv.apply(model, plan, model_data={KV_BASES_KEY: bases}) as session:
        out = session.prefill(prompt)
        resident = session.resident_bytes()
        rows = predict_resident(plan, session.geometry, prompt.shape[1], dtype_bytes=out.logits.element_size())
        predicted = sum(r.resident_bytes for r in rows)
        kw = {session.cache_keyword: session.cache}
        token, tokens = out.logits[:, -1:].argmax(-1), []
        for _ in range(args.new_tokens):
            tokens.append(int(token))
            out = model(token, use_cache=True, **kw)
            token = out.logits[:, -1:].argmax(-1)
    vanilla = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)[0, prompt.shape[1]:].tolist()
    full = sum(r.full_bytes for r in rows)
    full16 = full_cache_bytes_16bit(geo, prompt.shape[1])
    print(f"\nresident K/V after prefill of {prompt.shape[1]} tokens ({out.logits.dtype} compute): measured "
          f"{resident.total:,} B, memory model {predicted:,} B ({'equal' if resident.total == predicted else 'DIFFERENT'}"
          f"); full cache in the compute dtype {full:,} B ({full / resident.total:.2f}x), 16-bit full cache "
          f"{full16:,} B ({full16 / resident.total:.2f}x); bases {resident.bases:,} B (once per model, separate)")
    per_layer_equal = all(int(m) == r.resident_bytes for m, r in zip(resident.per_layer, rows))
    print(f"per layer equal: {per_layer_equal}")
    print(f"greedy {args.new_tokens} tokens under the plan: {tok.decode(tokens)!r}")
    agree = sum(a == b for a, b in zip(tokens, vanilla))
    print(f"vanilla greedy agrees on {agree}/{args.new_tokens} tokens; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
