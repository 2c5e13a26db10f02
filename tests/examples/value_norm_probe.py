"""Run in a fresh interpreter that has the installed example on PYTHONPATH; prints one JSON line.

Checks, with nothing from the checkout on ``sys.path``: the registry found ``value-norm`` through the
entry point, a plan routing it to some layers of a tiny model validates, survives a save/load round
trip, and runs under ``polykv.apply`` with ``generate``; the positions every layer keeps equal a naive
re-computation from the values the model produced; ``select`` on small tensors equals the same naive
selection.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.contract.rules import SelectionContext
from polykv.plan import OpSpec, load_plan, per_layer_plan, validate_plan
from polykv.testing import tiny_model

PROMPT, NEW, SLACK = 20, 10, 2


def naive_keep(stored: list[tuple[int, list[float]]], capacity: int, sinks: int) -> list[tuple[int, list[float]]]:
    """The first ``sinks`` entries, then the largest L2 norms, in storage order (plain Python floats)."""
    n_first = min(sinks, capacity)
    norm = {i: math.sqrt(sum(x * x for x in v)) for i, (_, v) in enumerate(stored)}
    rest = sorted(range(n_first, len(stored)), key=lambda i: (-norm[i], i))[:capacity - n_first]
    return [stored[i] for i in sorted(list(range(n_first)) + rest)]


def check_tensors(rule_cls) -> int:
    """``select`` on random [B, Hkv, T, d] values equals ``naive_keep`` for several capacities and sinks."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, T, d = 2, 3, 9, 5
    values = torch.randn(B, Hkv, T, d, generator=g, dtype=torch.float64)
    ctx = SelectionContext(layer_idx=0, phase="prefill", keys=torch.randn(B, Hkv, T, d, generator=g),
                           positions=torch.arange(T).expand(B, Hkv, T), tokens_seen=T, scaling=d ** -0.5,
                           values=values)
    checked = 0
    for sinks in (0, 2, 4):
        for capacity in (1, 3, 6, 8):
            got = rule_cls(sinks=sinks).select(ctx, capacity).tolist()
            for b in range(B):
                for h in range(Hkv):
                    stored = [(j, values[b, h, j].tolist()) for j in range(T)]
                    want = [j for j, _ in naive_keep(stored, capacity, sinks)]
                    assert got[b][h] == want, (sinks, capacity, b, h, got[b][h], want)
                    checked += 1
    return checked


def main() -> None:
    registry = polykv.get_registry()
    entry = registry.entry("rule", "value-norm")
    rule_cls = entry.obj
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    ops = [  # layer 0: both phases; layer 1: full; layer 2: decode only, default sinks
        {"prefill": OpSpec(rule="value-norm", capacity=12, params={"sinks": 2}),
         "decode": OpSpec(rule="value-norm", capacity=12, params={"sinks": 2})},
        {},
        {"decode": OpSpec(rule="value-norm", capacity=16)},
    ]
    plan = per_layer_plan(geo, ops, decode_slack=SLACK)
    validate_plan(plan, registry=registry, geometry=geo)
    path = Path(tempfile.mkdtemp()) / "value-norm-plan.json"
    plan.save(str(path))
    plan = load_plan(str(path), registry=registry)

    chunks: list[list[torch.Tensor]] = [[] for _ in range(geo.num_layers)]  # per layer: [B, Hkv, t, d]
    def capture(layer):
        def hook(module, args, out):
            B, t, _ = out.shape
            chunks[layer].append(out.detach().view(B, t, geo.num_kv_heads, geo.head_dim).transpose(1, 2))
        return hook
    handles = [model.model.layers[i].self_attn.v_proj.register_forward_hook(capture(i))
               for i in range(geo.num_layers)]
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        kept = [layer.positions.tolist() for layer in session.cache.layers]
    for h in handles:
        h.remove()

    want = []
    for i, lp in enumerate(plan.layers):
        per_head = []
        for h in range(geo.num_kv_heads):
            stored, seen = [], 0
            for n, chunk in enumerate(chunks[i]):
                stored += [(seen + j, chunk[0, h, j].tolist()) for j in range(chunk.shape[2])]
                seen += chunk.shape[2]
                op, limit = (lp.prefill, 0) if n == 0 else (lp.decode, SLACK)
                cap = op.resolve_capacity(seen)
                if cap is not None and len(stored) > cap + limit:
                    stored = naive_keep(stored, cap, int({**rule_cls.defaults, **op.params}["sinks"]))
            per_head.append([p for p, _ in stored])
        want.append([per_head])
    print(json.dumps({"plugin": entry.plugin, "version": entry.version, "module": sys.modules[rule_cls.__module__].__file__,
                      "generated": list(out.shape), "kept": kept, "want": want, "forwards": len(chunks[0]),
                      "tensor_cases": check_tensors(rule_cls),
                      "bare_adapters": getattr(importlib.util.find_spec("adapters"), "origin", None)}))


if __name__ == "__main__":
    main()
