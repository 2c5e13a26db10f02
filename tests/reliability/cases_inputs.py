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


# -- profiles (through `polykv solve`) ------------------------------------------------------------------
_PROFILE_TEXT = json.dumps(profile_dict())
RAW_PROFILES = {
    "duplicate-key": (_PROFILE_TEXT.replace('"schema_version": 1', '"schema_version": 1, "schema_version": 1'),
                      "'schema_version' appears twice"),
    "surrogate": (_PROFILE_TEXT.replace('"model_type": "unknown"', '"model_type": "\\udfff"'), "model.model_type"),
    "deep-nesting": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
}
for _name, (_text, _expect) in RAW_PROFILES.items():
    add(f"profile-raw-{_name}", "profile", lambda d, t=_text: _solve(d, t), _expect, ("out.plan.json",))

_STAT = {"columns": ["snapkv", "h2o"], "values": [[0.9, 0.8], [0.7, 0.6]], "higher_is_better": True}
PROFILE_VALUES = [
    ("metric-neg", "metrics.l2.0.0", -5, "metrics.l2"), ("metric-huge", "metrics.l2.1.3", 1e308, "metrics.l2"),
    ("metric-above-bound", "metrics.l2.0.1", 1e13, "metrics.l2"),
    ("stat-huge", "stats.cos", dict(_STAT, values=[[1e308, 0.8], [0.7, 0.6]]), "stats.cos.values"),
    ("keep-denormal", "configs.1.keep", 5e-324, "configs[1].keep"),
    ("prov-context-neg", "provenance.context_tokens", -5, "provenance.context_tokens"),
    ("prov-context-huge", "provenance.context_tokens", 10 ** 30, "provenance.context_tokens"),
    ("prov-context-float", "provenance.context_tokens", 512.5, "provenance.context_tokens"),
    ("prov-seed-str", "provenance.seed", "0", "provenance.seed"),
    ("prov-seed-neg", "provenance.seed", -1, "provenance.seed"),
    ("prov-dtype", "provenance.dtype", "int8", "provenance.dtype"),
    ("prov-versions-int", "provenance.versions", {"polykv": 1}, "provenance.versions"),
    ("prov-corpus-int", "provenance.corpus", 5, "provenance.corpus"),
    ("model-heads-0", "model.num_heads", 0, "model.num_heads"),
    ("model-type-int", "model.model_type", 5, "model.model_type"),
]
for _id, _path, _value, _expect in PROFILE_VALUES:
    add(f"profile-{_id}", "profile", lambda d, p=_path, v=_value: _solve(d, mutate(profile_dict(), p, v)), _expect,
        ("out.plan.json",))


def _unknown_rule_profile() -> dict:
    prof = profile_dict()
    for c in prof["configs"]:
        if c["rule"] == "snapkv":
            c["rule"] = "magic"
    return prof


# a rule the registry does not know is refused before solving, naming the profile's config
for _solver, _basis in (("moend-greedy", "nominal"), ("moend-greedy", "resident"), ("exact", "nominal")):
    def _setup(d, s=_solver, b=_basis):
        argv = _solve(d, _unknown_rule_profile(), "--solver", s, "--basis", b)
        argv[argv.index("--budget") + 1] = "1x"  # room for every layer at keep 1: the rule is never chosen
        return argv
    add(f"profile-unknown-rule-{_solver}-{_basis}", "profile", _setup, "prof.json: configs[", ("out.plan.json",))

# -- solver parameters ------------------------------------------------------------------------------------
SOLVER_PARAMS = [
    ("pyramid", "window=0", "'window'"), ("pyramid", "window=-5", "'window'"), ("pyramid", "window=abc", "'window'"),
    ("pyramid", "beta=nan", "'beta'"), ("pyramid", "beta=0", "'beta'"), ("pyramid", "beta=2.5", "'beta'"),
    ("pyramid", "rule_params=3", "'rule_params'"), ("pyramid", "rule=5", "'rule'"),
    ("exact", "rules=snapkv", "'rules'"), ("exact", "rules=[]", "'rules'"),
    ("exact", 'rules=["snapkv","snapkv"]', "'rules'"), ("exact", "rules=[5]", "'rules'"),
    ("exact", "metric=5", "'metric'"), ("moend-greedy", "rule=[1]", "'rule'"),
    ("uniform", "mode=2d", "'mode'"), ("uniform", "k_bits=nan", "'k_bits'"), ("uniform", "v_bits=3", "'v_bits'"),
    ("uniform", "rules=snapkv", "'rules'"),
    ("quant-only", "keep=abc", "'keep'"), ("quant-only", "keep=nan", "'keep'"), ("quant-only", "keep=5e-324", "'keep'"),
    ("quant-only", "keep=1.5", "'keep'"), ("quant-only", "ref_k_bits=nan", "'ref_k_bits'"),
    ("profile-route", "clip_percentile=abc", "'clip_percentile'"),
    ("profile-route", "clip_percentile=101", "'clip_percentile'"), ("profile-route", "scope=all", "'scope'"),
    ("profile-route", "allocation=greedy", "'allocation'"), ("profile-route", "rules=[]", "'rules'"),
    ("random-placement", "count=nan", "'count'"), ("random-placement", "count=0", "'count'"),
    ("random-placement", "seed=-1", "'seed'"), ("random-placement", "index=x", "'index'"),
]
for _solver, _param, _expect in SOLVER_PARAMS:
    add(f"solve-param-{_solver}-{_param}", "cli", lambda d, s=_solver, p=_param: _solve(
        d, profile_dict(), "--solver", s, "--param", p), _expect, ("out.plan.json",))


def _spec_with_solver(params: dict) -> dict:
    spec = spec_dict()
    spec.update(profile="prof.json", budgets=["4x"], solvers=[{"name": "mine2", "solver": "exact", "params": params}])
    return spec


for _tag, _params in (("rules-string", {"rules": "snapkv"}), ("rules-empty", {"rules": []}),
                      ("rules-duplicate", {"rules": ["snapkv", "snapkv"]}), ("metric-int", {"metric": 3})):
    add(f"spec-solver-{_tag}", "spec", lambda d, p=_params: _study(d, _spec_with_solver(p)), "solvers[0].params",
        ("r.jsonl",))


# -- study specs and task files ---------------------------------------------------------------------------
_SPEC_TEXT = json.dumps(spec_dict())
RAW_SPECS = {
    "duplicate-key": (_SPEC_TEXT.replace('"baseline": true', '"baseline": true, "baseline": false'),
                      "'baseline' appears twice"),
    "surrogate-name": (_SPEC_TEXT.replace('"name": "bad"', '"name": "\\ud83d"'), "spec.json"),
    "deep-nesting": ('{"name": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
}
for _name, (_text, _expect) in RAW_SPECS.items():
    add(f"spec-raw-{_name}", "spec", lambda d, t=_text: _study(d, t), _expect, ("r.jsonl",))

_LINE = json.dumps(longbench_line(0))
TASK_LINES = {
    "duplicate-key": _LINE.replace('"answers":', '"context": "again", "answers":'),
    "surrogate": _LINE.replace("Paris is", "\\udc00 is"),
    "deep-nesting": '{"context": ' + "[" * 100_000 + "]" * 100_000 + "}",
}
for _name, _line in TASK_LINES.items():
    add(f"taskfile-longbench-{_name}", "taskfile", lambda d, ln=_line: _file_study(
        d, "longbench_file", [ln, longbench_line(1)]), "items.jsonl line 1", ("r.jsonl",))


# -- model folders whose config.json cannot be read --------------------------------------------------------
def _broken_config(d: Path, kind: str) -> str:
    folder = model_folder(d)
    path = os.path.join(folder, "config.json")
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "latin1":
        Path(path).write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    elif kind == "list":
        Path(path).write_text("[]", encoding="utf-8")
    elif kind == "duplicate":
        Path(path).write_text('{"model_type": "llama", "model_type": "qwen2"}', encoding="utf-8")
    elif kind == "dangling":
        os.symlink(os.path.join(folder, "gone.json"), path)
    return folder


CONFIG_KINDS = {"fifo": "not a regular file", "folder": "is a folder", "latin1": "not UTF-8",
                "list": "config.json: expected a JSON object", "duplicate": "appears twice",
                "dangling": "config.json"}
for _kind, _expect in CONFIG_KINDS.items():
    add(f"cli-plan-model-config-{_kind}", "cli", lambda d, k=_kind: ["plan", "validate", write(
        d, "p.json", plan_dict()), "--model", _broken_config(d, k)], _expect)
    add(f"cli-calibrate-config-{_kind}", "cli", lambda d, k=_kind: ["calibrate", _broken_config(d, k), "-o",
                                                                    "x.profile.json"], _expect,
        ("x.profile.json", "x.qstats.safetensors"))
