"""Bad inputs a reader used to accept or word unclearly: plans, profiles, solver parameters, specs, task files.

Duplicate keys, lone surrogates and deep nesting (the strict JSON reader), provenance and profile values
out of range (negative or overflowing losses, a keep of 5e-324, a context of 10^30 tokens, an unknown cache
dtype), solver parameters of the wrong type or range, files that are not UTF-8 and a model folder whose
config.json is not a regular file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cases import (DELETE, _file_study, _solve, _study, add, longbench_line, model_folder, mutate, plan_dict,
                   profile_dict, spec_dict, write)

# -- plans ----------------------------------------------------------------------------------------------
_PLAN_TEXT = json.dumps(plan_dict())
RAW_PLANS = {
    "duplicate-key": (_PLAN_TEXT.replace('"note": "hand-made"', '"note": "a", "note": "b"'), "'note' appears twice"),
    "duplicate-layer-key": (_PLAN_TEXT.replace('"k_bits": 8,', '"k_bits": 8, "k_bits": 4,'), "'k_bits' appears twice"),
    "surrogate-name": (_PLAN_TEXT.replace('"name": "tiny"', '"name": "\\ud800"'), "model.name"),
    "deep-nesting": ("[" * 100_000 + "]" * 100_000, "nested deeper"),
}
for _name, (_text, _expect) in RAW_PLANS.items():
    add(f"plan-raw-{_name}", "plan", lambda d, t=_text: ["plan", "show", write(d, "p.json", t)], _expect)

PROVENANCE = [
    ("cache-dtype-int8", "cache_dtype", "int8"), ("cache-dtype-int", "cache_dtype", 16),
    ("context-huge", "context_tokens", 10 ** 30), ("context-above-max", "context_tokens", (1 << 24) + 1),
    ("loss-neg", "predicted_loss", -5), ("loss-huge", "predicted_loss", 1e300),
    ("bytes-huge", "predicted_bytes", 10 ** 30), ("batch-0", "batch", 0), ("batch-huge", "batch", 10 ** 12),
    ("batch-str", "batch", "1"), ("basis-unknown", "basis", "peak"), ("budget-list", "budget", [8]),
    ("budget-two-kinds", "budget", {"ratio": 8, "bytes": 5}), ("budget-unknown-kind", "budget", {"percent": 12}),
    ("budget-empty", "budget", {}), ("budget-ratio-0", "budget", {"ratio": 0}),
    ("budget-ratio-str", "budget", {"ratio": "8x"}), ("budget-bytes-huge", "budget", {"bytes": 1e30}),
    ("created-text", "created", "yesterday"), ("created-int", "created", 2026), ("solver-int", "solver", 3),
    ("params-list", "params", [1]), ("version-int", "polykv_version", 1), ("fingerprint-int", "profile_fingerprint", 7),
]
for _id, _key, _value in PROVENANCE:
    add(f"plan-prov-{_id}", "plan", lambda d, k=_key, v=_value: ["plan", "show", write(
        d, "p.json", mutate(plan_dict(), f"provenance.{k}", v))], f"provenance.{_key}")
add("plan-validate-prov-context-huge", "plan", lambda d: ["plan", "validate", write(
    d, "p.json", mutate(plan_dict(), "provenance.context_tokens", 10 ** 30))], "provenance.context_tokens")


def _pyramid_group(params: dict, capacity: int = 16) -> dict:
    plan = plan_dict()
    for lp in plan["layers"]:
        lp["prefill"] = {"rule": "pyramidkv", "capacity": capacity}
    plan["provenance"]["context_tokens"] = 1024
    plan["allocation"] = [{"allocator": "pyramidkv", "layers": [0, 1], "params": params}]
    return plan


# the pyramid's window must stay below the group's average budget: the plan field is named, not a CLI flag
add("plan-pyramid-window-above-budget", "plan", lambda d: ["plan", "show", write(
    d, "p.json", _pyramid_group({"window": 32}))], "allocation[0].params.window")
add("plan-pyramid-window-validate", "plan", lambda d: ["plan", "validate", write(
    d, "p.json", _pyramid_group({"window": 32}))], "allocation[0].params.window")
