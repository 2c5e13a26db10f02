"""Cost of a long-context calibration with the end-to-end kl metric: set-up time and seconds per kl unit.

A partial run of :func:`polykv.profiling.calibrate.calibrate` on the default model (SmolLM2-135M-Instruct):
everything before the first layer is measured is *set-up* (per-model data, the calibration captures, the held-out
reference log-probabilities, the held-out prefills and, where the code has them, the follow-up layer outputs);
then only the layers named by ``--layers`` are measured (the others are skipped; the run stops after the last
one). A *kl unit* is one (layer, config) one-layer plan on every held-out sequence; its cost depends on the
layer when the layers below it are not run, hence several layers. Usage::

    OMP_NUM_THREADS=1 python bench/calibration_kl.py [--tokens 2048] [--prefix 512] [--rules snapkv]
        [--keeps 0.125,1.0] [--bits 16,4] [--sequences 1] [--validate 1] [--layers 0,15,29]

Prints one line per measured layer and a summary line (set-up seconds, mean seconds per kl unit and per l2 unit).
"""

from __future__ import annotations

import argparse
import time


class _Stop(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rules", default="snapkv", help="comma-separated, or 'all' (every registered rule)")
    ap.add_argument("--keeps", default="0.125,1.0")
    ap.add_argument("--bits", default="16,4")
    ap.add_argument("--sequences", type=int, default=1)
    ap.add_argument("--validate", type=int, default=1)
    ap.add_argument("--layers", default="0,15,29", help="layers measured (the others are skipped)")
    ap.add_argument("--setup-only", action="store_true", help="stop when the first layer would be measured")
    args = ap.parse_args()

    import numpy as np
    import torch

    import polykv.profiling.calibrate as cal
    from polykv.profiling import endtoend as e2e
    from polykv.models import load_default_model
    from polykv.registry import get_registry

    torch.set_num_threads(1)
    model, tokenizer = load_default_model()
    registry = get_registry()
    rules = list(cal.default_rules(registry)) if args.rules == "all" else [r for r in args.rules.split(",") if r]
    settings = cal.CalibrationSettings(rules=rules, keeps=tuple(float(k) for k in args.keeps.split(",")),
                                       bits=tuple(int(b) for b in args.bits.split(",")), prefix=args.prefix)
    settings = cal.attrs.evolve(settings, rule_params=cal.tokenizer_params(registry, rules, tokenizer))
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, _ = cal.corpus_sequences(tokenize, args.sequences + args.validate, args.tokens, seed=0)
    wanted = [int(x) for x in args.layers.split(",")]
    marks: dict = {"kl": []}
    real_layer, real_kl = cal._layer, e2e.layer_kl

    def timed_kl(*a, **kw):
        t, c = time.perf_counter(), time.process_time()
        out = real_kl(*a, **kw)
        marks["kl"].append((a[2], time.perf_counter() - t, len(a[4]), time.process_time() - c))
        return out

    def layer(model_, geometry, index, *a, **kw):
        marks.setdefault("setup", (time.perf_counter() - marks["start"], time.process_time() - marks["cpu"]))
        if args.setup_only:
            raise _Stop()
        if index not in wanted:
            return {"l2": np.zeros(len(a[2])), "cosine": np.zeros(len(rules)), "entropy": np.zeros(1),
                    "kl": np.zeros(len(e2e.kl_columns(a[2], settings.kl_configs)))}
        t = time.perf_counter()
        out = real_layer(model_, geometry, index, *a, **kw)
        whole = time.perf_counter() - t
        _, kl_s, cols, kl_cpu = marks["kl"][-1]
        n_l2 = len(a[2])
        print(f"layer {index}: {cols} kl units {kl_s:.1f} s ({kl_s / cols:.2f} s/unit wall, {kl_cpu / cols:.2f} s/unit "
              f"CPU), {n_l2} l2 units {whole - kl_s:.1f} s", flush=True)
        marks.setdefault("l2", []).append((whole - kl_s) / n_l2)
        if index == max(wanted):
            raise _Stop()
        return out

    cal._layer, e2e.layer_kl = layer, timed_kl
    marks["start"], marks["cpu"] = time.perf_counter(), time.process_time()
    try:
        cal.calibrate(model, seqs[:args.sequences], settings, heldout=seqs[args.sequences:], registry=registry)
    except _Stop:
        pass
    finally:
        cal._layer, e2e.layer_kl = real_layer, real_kl
    if args.setup_only:
        print(f"set-up {marks['setup'][0]:.1f} s wall, {marks['setup'][1]:.1f} s CPU; rules {args.rules} keeps "
              f"{args.keeps} bits {args.bits}; tokens {args.tokens} prefix {args.prefix} held-out {args.validate}")
        return 0
    wall = {layer_: round(s / n, 2) for layer_, s, n, _ in marks["kl"]}
    cpu = {layer_: round(c / n, 2) for layer_, _, n, c in marks["kl"]}
    print(f"set-up {marks['setup'][0]:.1f} s wall, {marks['setup'][1]:.1f} s CPU; kl s/unit by layer: wall {wall}, "
          f"CPU {cpu}; "
          f"l2 s/unit {np.mean(marks['l2']):.3f}; tokens {args.tokens} prefix {args.prefix} held-out {args.validate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
