"""Bad inputs around the per-model data a plan names (its ``model_data`` field): malformed entries, keys no
rule reads, and a named file that is not the data (refused naming it when a study runs the plan)."""

from __future__ import annotations

from cases import SHIPPED_PLAN, TINY, add, mutate, plan_dict, write  # noqa: F401

TRI = {"rule": "triattention", "capacity": 32}


def _validate(d, value, *, rule=None):
    plan = plan_dict() if rule is None else mutate(plan_dict(), "layers.0.prefill", rule)
    plan["model_data"] = value
    return ["plan", "validate", write(d, "p.json", plan)]


add("plan-model-data-list", "plan", lambda d: _validate(d, ["x.safetensors"], rule=TRI), "model_data'")
add("plan-model-data-empty-path", "plan", lambda d: _validate(d, {"triattention": ""}, rule=TRI),
    "model_data.triattention'")
add("plan-model-data-number", "plan", lambda d: _validate(d, {"triattention": 3}, rule=TRI),
    "model_data.triattention'")
add("plan-model-data-unread-key", "plan", lambda d: _validate(d, {"triattention": "x.safetensors"}),
    "model_data.triattention'")


def _study_bad_file(d):
    plan = mutate(plan_dict(), "layers.0.prefill", TRI)
    plan["model_data"] = {"triattention": "stats.qstats.safetensors"}
    write(d, "stats.qstats.safetensors", b"not safetensors")
    write(d, "plan.json", plan)
    spec = {"name": "bad", "model": {"tiny": dict(TINY)}, "context_tokens": 128, "plans": {"mine": "plan.json"},
            "baseline": False, "tasks": [{"task": "passkey", "params": {"length": 128, "digits": 3,
                                                                         "max_new_tokens": 2}, "samples": 1, "seed": 0}]}
    return ["study", write(d, "spec.json", spec), "--results", str(d / "r.jsonl")]


add("study-plan-model-data-not-the-data", "spec", _study_bad_file, "stats.qstats.safetensors")
