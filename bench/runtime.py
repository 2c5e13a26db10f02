"""Runtime benchmark: prefill time, decode speed, peak memory and resident KV bytes, as ratios to vanilla.

Every configuration runs in the same process on the same prompt (random token ids, no padding):

* ``vanilla``: the model with its own attention and a transformers ``DynamicCache``;
* ``full``: the keep-everything 16-bit plan through the polykv runtime (its overhead);
* ``full-k4v4``: the keep-everything plan with every layer's keys and values at 4 bits (KIVI, group 32,
  residual 32);
* every retention rule at 4x and 8x (capacity = context / ratio; the rule in both phases when it
  supports decode, else prefill only with a ``full`` decode op);
* ``mixed``: a per-layer plan cycling rules, half the layers at K8/V4 (KIVI).

After each context it prints the attention-free ceiling: vanilla's decode speed over a 16-token
context (every other cost of a step, almost no attention) as a ratio to vanilla at that context,
which estimates the most any compression plan can gain in decode speed on this model and machine
(it is itself one timing: a plan may beat it by the run's noise).

Measured per configuration and context: prefill seconds (one forward over the prompt), decode
tokens/s (greedy steps after it; both compute only the last row's logits, as ``generate`` does),
peak memory above the pre-run baseline (CUDA: allocator peak;
CPU: the kernel's resident-set high-water mark, reset on entry through ``/proc/self/clear_refs``, because
CPU tensor memory is invisible to tracemalloc; where that file cannot be written, the resident set
sampled every 2 ms, which is said in the output: a sampling thread slows paths of many small
operations, such as H2O's chunked prefill, by up to 0.2x of vanilla's time on two cores),
and resident KV bytes after decoding (vanilla: the DynamicCache tensors; polykv: stores, with
metadata apart).

    python bench/runtime.py            # SmolLM2-135M, contexts 2048 and 4096, 32 decode steps
    python bench/runtime.py --tiny     # a tiny random Llama, seconds
    python bench/runtime.py --contexts 1024 --steps 8 --only vanilla full full-k4v4 h2o
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import threading
import time

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.runtime.cache import cache_keyword, output_cache
from polykv.plan import OpSpec

RULES = ["streamingllm", "h2o", "snapkv", "tova", "triattention", "random", "key-norm", "adakv"]
MIXED = ["snapkv", "h2o", "tova", "streamingllm", "triattention", "key-norm"]


class PeakMemory:
    """Peak bytes above the baseline taken on entry: CUDA allocator peak, or on CPU the resident set's
    high-water mark (reset on entry), or the resident set sampled every 2 ms where it cannot be reset."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        _trim()
        self.base = self.high = _rss()
        self._thread = None
        if not _reset_high_water_mark():
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.high = max(self.high, _rss())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self._thread is None:
            self.peak = max(_high_water_mark(), _rss()) - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.high, _rss()) - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water_mark() -> int:
    """Peak resident set since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _reset_high_water_mark() -> bool:
    """Reset the resident-set high-water mark to the current resident set (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _high_water_mark()
        return True
    except OSError:
        return False


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def run_one(model, ids, steps, plan=None, model_data=None):
    """Prefill ``ids`` then ``steps`` greedy decode steps; returns a dict of measurements."""
    device = ids.device
    with torch.no_grad(), PeakMemory(device) as peak:
        if plan is None:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
            cache = output_cache(out)
        else:
            session = polykv.apply(model, plan, model_data=model_data).__enter__()
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = session.prefill(ids, logits_to_keep=1)
            _sync(device)
            prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
            cache = session.cache
        tok = out.logits[:, -1:].argmax(-1)
        del out
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        _sync(device)
        decode, decode_cpu = time.perf_counter() - t0, time.process_time() - c0
        if plan is None:
            kv, meta = _cache_bytes(cache), 0
        else:
            rb = session.resident_bytes()
            kv, meta = rb.total, rb.metadata_total
            session.__exit__(None, None, None)
        del cache, out
    return {"prefill_s": prefill, "prefill_cpu_s": prefill_cpu,
            "decode_tok_s": steps / decode if steps else float("nan"),
            "decode_tok_cpu_s": steps / decode_cpu if steps and decode_cpu else float("nan"),
            "peak_bytes": peak.peak, "kv_bytes": kv, "meta_bytes": meta}


def configs(geo, context: int, only: set[str] | None, registry, kivi: dict):
    """(name, plan) pairs for one context length."""
    out = [("vanilla", None), ("full", polykv.full_plan(geo)),
           ("full-k4v4", polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=kivi))]
    for rule in RULES:
        decodes = "decode" in registry.rule(rule).phases
        for ratio in (4, 8):
            cap = max(1, context // ratio)
            op = OpSpec(rule=rule, capacity=cap)
            plan = polykv.uniform_plan(geo, prefill=op, decode=op if decodes else None, decode_slack=16)
            out.append((f"{rule}@{ratio}x", plan))
    layers = []
    for i in range(geo.num_layers):
        rule = MIXED[i % len(MIXED)]
        op = OpSpec(rule=rule, capacity=max(1, context // (4 if i % 2 else 8)))
        dec = op if "decode" in registry.rule(rule).phases else OpSpec(rule="h2o", capacity=op.capacity)
        layers.append({"prefill": op, "decode": dec, "k_bits": 8 if i % 2 else 16, "v_bits": 4 if i % 2 else 16,
                       "quantizer_params": kivi if i % 2 else {}})
    out.append(("mixed", polykv.per_layer_plan(geo, layers, decode_slack=16)))
    if only:
        out = [(n, p) for n, p in out if n in only or n.split("@")[0] in only]
    return out


def load(args):
    if args.tiny:
        from polykv.testing import tiny_model

        return tiny_model("llama", layers=4, heads=8, kv_heads=2, head_dim=64, vocab=512,
                          attn_implementation="sdpa")
    from polykv.models import load_default_model

    model, _ = load_default_model()
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 2048 4096)")
    ap.add_argument("--steps", type=int, default=32, help="greedy decode steps after prefill")
    ap.add_argument("--only", nargs="+", default=None, help="config names or rule names to run")
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32 on CPU, bf16 on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a busy machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    contexts = args.contexts or ([512, 1024] if args.tiny else [2048, 4096])
    model = load(args).to(device=device, dtype=dtype).eval()
    geo = geometry_of_model(model)
    registry = polykv.get_registry()
    kivi = {"group_size": 32, "residual": 32}
    from polykv.adapters.rules.query_stats import compute_query_stats

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    stats = compute_query_stats(model, [torch.randint(1, vocab, (1, 256), generator=g).to(device)])
    print(f"# {type(model).__name__} {geo.num_layers} layers, {geo.num_heads} heads, {geo.num_kv_heads} KV heads, "
          f"d={geo.head_dim}; device {device}, {dtype}, {torch.get_num_threads()} threads; {args.steps} decode steps")
    print("# 'x van' = ratio to vanilla in this run; 'cpu' = the same ratio on process CPU time (robust to a "
          "busy machine)")
    if device.type == "cuda":
        print("# peak = CUDA allocator peak above the pre-run allocation")
    elif _reset_high_water_mark():
        print("# peak = resident-set high-water mark (VmHWM, reset before each run) above the pre-run resident set")
    else:
        print("# peak = resident set sampled every 2 ms (VmHWM cannot be reset here); the sampling thread slows "
              "paths of many small operations")
    print(f"{'config':<18}{'ctx':>6}{'prefill s':>10}{'x van':>7}{'cpu':>6}{'dec tok/s':>10}{'x van':>7}{'cpu':>6}"
          f"{'peak MiB':>10}{'x van':>7}{'KV MiB':>9}{'x van':>7}{'meta MiB':>9}")
    mib = 1 / 2 ** 20
    warm = torch.randint(1, vocab, (1, 64), generator=g).to(device)
    for _, plan in configs(geo, 64, {"vanilla", "full", "h2o"}, registry, kivi):  # warm-up, not reported
        run_one(model, warm, 2, plan, model_data={"triattention": stats})
    for context in contexts:
        ids = torch.randint(1, vocab, (1, context), generator=g).to(device)
        base = None
        for name, plan in configs(geo, context, set(args.only) if args.only else None, registry, kivi):
            r = run_one(model, ids, args.steps, plan, model_data={"triattention": stats})
            base = base or (r if name == "vanilla" else None)
            ref = base or r

            def ratio(key):
                return r[key] / ref[key] if ref[key] else float("nan")
            print(f"{name:<18}{context:>6}{r['prefill_s']:>10.3f}{ratio('prefill_s'):>7.2f}"
                  f"{ratio('prefill_cpu_s'):>6.2f}{r['decode_tok_s']:>10.2f}{ratio('decode_tok_s'):>7.2f}"
                  f"{ratio('decode_tok_cpu_s'):>6.2f}{r['peak_bytes'] * mib:>10.1f}{ratio('peak_bytes'):>7.2f}"
                  f"{r['kv_bytes'] * mib:>9.2f}{ratio('kv_bytes'):>7.3f}{r['meta_bytes'] * mib:>9.2f}", flush=True)
        if base is not None and args.steps:
            # What decode could gain if attention cost nothing: vanilla over a 16-token context does all the
            # rest of the step's work (weights, norms, RoPE, sampling) and almost no attention.
            floor = run_one(model, ids[:, :16], args.steps)
            print(f"# {context}: attention-free ceiling: vanilla decodes {floor['decode_tok_s']:.2f} tok/s over 16 "
                  f"tokens = {floor['decode_tok_s'] / base['decode_tok_s']:.2f}x vanilla at {context} (cpu "
                  f"{floor['decode_tok_cpu_s'] / base['decode_tok_cpu_s']:.2f}x): about the most any plan can gain, within "
                  f"this run's timing noise", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
