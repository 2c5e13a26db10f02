"""KVzip's prefill cost on the default model: the prompt forward plus its context-reconstruction probe,
against a vanilla prefill of the same prompt measured in the same run.

Prints, per length: vanilla prefill seconds, kvzip prefill seconds (prompt + probe + selection), their
ratio, the probe's extra forward tokens, and the tokens kept per layer. Usage::

    python bench/kvzip_prefill.py [--lengths 1024 2048] [--ratio 0.3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import polykv
from polykv.adapters.rules.kvzip import prompt_params
from polykv.models import load_default_model
from polykv.models.corpus import corpus_texts
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--ratio", type=float, default=0.3, help="fraction of the prompt kept per layer and head")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    model, tok = load_default_model()
    geo = geometry_of_model(model)
    text = " ".join(corpus_texts("mixed", 8, min_chars=4 * max(args.lengths), seed=0))
    all_ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    params = prompt_params(tok)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity_ratio=args.ratio, params=params),
                               decode="full")
    print(f"{'tokens':>7} {'vanilla s':>10} {'kvzip s':>9} {'ratio':>6} {'probe tokens':>13} kept/layer")
    for T in args.lengths:
        ids = all_ids[:, :T]
        with torch.no_grad():
            vanilla = best_of(lambda: model(ids, use_cache=True), args.repeats)
            with polykv.apply(model, plan) as session:
                kvzip = best_of(lambda: session.prefill(ids), args.repeats)
                probe, kept = session.cache.probe_tokens, session.cache.stored_tokens()[0]
        print(f"{T:>7} {vanilla:>10.2f} {kvzip:>9.2f} {kvzip / vanilla:>6.2f} {probe:>13} {kept}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
