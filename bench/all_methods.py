"""One plan that runs the nine methods of PolyKV's study plus TriAttention (and Ada-KV) on different layers.

Builds ``examples/smollm2-all-methods.4x.plan.json`` for the default model (30 layers): each
method owns a block of layers, PyramidKV, CAKE and D2O blocks form allocation groups under their own
allocators, and every rule that runs in decode also evicts there. Then it prefills a 2k-token passkey
prompt, feeds the question, generates ``--new-tokens`` tokens greedily and prints the allocations,
resident bytes and the generated text. Usage::

    python bench/all_methods.py [--length 2048] [--new-tokens 64] [--ratio 4] [--out plans/...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.runtime.cache import cache_keyword
from polykv.models import load_default_model
from polykv.plan import AllocationGroup, LayerPlan, OpSpec, Plan, Provenance
from polykv.profiling.calibrate_settings import model_data_for
from polykv.registry import get_registry

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "profiles", "smollm2-135m-instruct.profile.json")
DEFAULT_OUT = os.path.join(HERE, "..", "examples", "smollm2-all-methods.4x.plan.json")

# (rule, params, allocator or None) per block of three layers, lowest layers first.
BLOCKS = [
    ("pyramidkv", {}, "pyramidkv"),
    ("cake", {}, "cake"),
    ("d2o", {}, "d2o"),
    ("h2o", {}, None),
    ("tova", {}, None),
    ("cam", {"rule": "h2o"}, None),
    ("snapkv", {}, None),
    ("scissorhands", {}, None),
    ("streamingllm", {}, None),
    ("triattention", {}, None),
]


def all_methods_plan(geo, ratio: float) -> Plan:
    registry = get_registry()
    per = geo.num_layers // len(BLOCKS)
    layers, groups = [], []
    for b, (rule, params, allocator) in enumerate(BLOCKS):
        first = b * per
        last = geo.num_layers if b == len(BLOCKS) - 1 else first + per
        for i in range(first, last):
            op = OpSpec(rule=rule, capacity_ratio=1 / ratio, params=params)
            if rule == "snapkv" and i == last - 1:
                op = OpSpec(rule="adakv", capacity_ratio=1 / ratio)  # Ada-KV's head-wise budgets on one layer
            decodes = "decode" in registry.rule(op.rule)(**op.params).phases
            layers.append(LayerPlan(layer=i, prefill=op, decode=op if decodes else OpSpec()))
        if allocator:
            groups.append(AllocationGroup(allocator=allocator, layers=tuple(range(first, last))))
    note = "PolyKV's nine methods + TriAttention + Ada-KV, one block of layers each"
    return Plan(layers=layers, model=polykv.plan.ModelInfo(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads,
                                                           head_dim=geo.head_dim, name="SmolLM2-135M-Instruct"),
                trigger=polykv.plan.TriggerSettings(decode_slack=32),
                provenance=Provenance(note=note, context_tokens=None), allocation=tuple(groups))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    geo = geometry_of_model(model)
    plan = all_methods_plan(geo, args.ratio)
    plan.save(args.out)
    print(f"wrote {os.path.relpath(args.out)}")
    item = get_registry().task("passkey")().make_items(tok, 1, seed=0, length=args.length)[0]
    ids = tok(item.context, return_tensors="pt", add_special_tokens=False).input_ids
    q = tok(item.question, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad(), polykv.apply(model, plan, model_data=model_data_for(PROFILE)) as session:
        cache = session.new_cache()
        model(ids, **{cache_keyword(model): cache}, use_cache=True)
        out = model(q, **{cache_keyword(model): cache}, use_cache=True)
        generated = []
        for _ in range(args.new_tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            generated.append(int(nxt))
            out = model(nxt, **{cache_keyword(model): cache}, use_cache=True)
        rb = session.resident_bytes()
        print(f"prompt {ids.shape[1]} tokens + question {q.shape[1]}; passkey {item.answers[0]}")
        print("allocations:", {k: v["budget"] for k, v in sorted(cache.allocations().items())})
        print("stored tokens per layer:", cache.stored_tokens())
        print(f"resident K/V bytes {rb.total}, metadata bytes {rb.metadata_total}")
    print(f"generated {len(generated)} tokens: {tok.decode(generated)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
