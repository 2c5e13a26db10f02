"""The bad-input table: plan files, profiles, study specs, task files and CLI arguments a careless user gives.

Every case prepares a fresh folder, names the argv and the text the one error line must contain (the
file or field to fix) and the output paths that must not exist afterwards. Files are written from
small in-memory originals (a 2-layer plan, a 2-layer profile, a tiny-model spec, LongBench/RULER lines).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable

import attrs

TINY = {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 128, "seed": 0}
SHIPPED_PLAN = Path(__file__).resolve().parents[2] / "plans" / "smollm2-135m-instruct.exact.8x.plan.json"


@attrs.define(frozen=True)
class Case:
    id: str
    group: str
    setup: Callable[[Path], list[str]]
    """Writes the case's files into the folder; returns argv."""
    expect: str
    """Text the error line must contain (the file, field or option to fix)."""
    outputs: tuple[str, ...] = ()
    """Paths (relative to the folder) that must not exist afterwards unless they did before."""


# -- originals ---------------------------------------------------------------------------------------

def plan_dict() -> dict[str, Any]:
    return {
        "schema_version": 1,
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "name": "tiny", "fingerprint": None},
        "trigger": {"decode_slack": 16},
        "provenance": {"note": "hand-made"},
        "layers": [
            {"layer": 0, "prefill": {"rule": "snapkv", "capacity": 64, "params": {"window": 8}},
             "decode": {"rule": "full"}, "k_bits": 8, "v_bits": 4, "quantizer": "kivi"},
            {"layer": 1, "prefill": {"rule": "full"}, "decode": {"rule": "h2o", "capacity_ratio": 0.5},
             "k_bits": 16, "v_bits": 16},
        ],
    }


def profile_dict() -> dict[str, Any]:
    import numpy as np

    from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
    from polykv.profiling.profile_writing import to_dict

    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    base = np.array([(1 - c.keep) + (16 - c.k_bits) / 40 + (16 - c.v_bits) / 60 for c in configs])
    table = np.stack([base, base * 1.3])
    return json.loads(json.dumps(to_dict(Profile.from_table(table, configs, (2, 2, 32)))))


def spec_dict() -> dict[str, Any]:
    return {"name": "bad", "model": {"tiny": dict(TINY)}, "context_tokens": 256, "plans": {"mine": "plan.json"},
            "baseline": True,
            "tasks": [{"task": "passkey", "params": {"length": 256, "digits": 3, "max_new_tokens": 3},
                       "samples": 2, "seed": 0}]}


def longbench_line(i: int, **kw) -> dict[str, Any]:
    rec = {"context": f"Passage {i}. Paris is the capital of France.", "input": f"Question {i}?",
           "answers": ["Paris"], "all_classes": None, "length": 10, "dataset": "hotpotqa", "_id": f"id{i}"}
    rec.update(kw)
    return rec


def ruler_line(i: int, **kw) -> dict[str, Any]:
    rec = {"input": f"Remember the number {1000 + i}.\nfiller text here.\nWhat is the number?",
           "outputs": [str(1000 + i)], "length": 20, "index": i}
    rec.update(kw)
    return rec


# -- writers -----------------------------------------------------------------------------------------

def write(folder: Path, name: str, content: Any) -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_text(json.dumps(content, indent=1), encoding="utf-8")
    return str(path)


def write_jsonl(folder: Path, name: str, lines: list[Any]) -> str:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines)
    return write(folder, name, text)


def model_folder(folder: Path, name: str = "model", **overrides) -> str:
    """A model folder holding only config.json (what every check before loading weights reads)."""
    from polykv.testing import tiny_model

    kw = dict(TINY, **overrides)
    path = folder / name
    tiny_model(**kw).config.save_pretrained(str(path))
    return str(path)


def mutate(base: dict, path: str, value: Any, *, delete: bool = False) -> dict:
    """A deep copy of ``base`` with the dotted ``path`` (list indices as numbers) set or deleted."""
    out = copy.deepcopy(base)
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = out
    for k in keys[:-1]:
        node = node[k]
    if delete:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return out


DELETE = object()


# -- case builders -----------------------------------------------------------------------------------

CASES: list[Case] = []


def case(id: str, group: str, expect: str, outputs: tuple[str, ...] = ()):
    def deco(fn):
        CASES.append(Case(id=id, group=group, setup=fn, expect=expect, outputs=outputs))
        return fn
    return deco


def add(id: str, group: str, setup: Callable[[Path], list[str]], expect: str, outputs: tuple[str, ...] = ()):
    CASES.append(Case(id=id, group=group, setup=setup, expect=expect, outputs=outputs))


# plan files: text that is not a plan ------------------------------------------------------------------
RAW_PLANS = {"empty": "", "open-brace": "{", "list": "[]", "null": "null", "number": "1", "string": '"plan"',
             "nan": '{"schema_version": 1, "layers": [], "x": NaN}', "infinity": '{"schema_version": Infinity}',
             "latin1": b'{"note": "caf\xe9"}', "binary": bytes(range(256)), "trailing-garbage": '{"a": 1} xyz',
             "utf16": '{"schema_version": 1}'.encode("utf-16")}
for _name, _text in RAW_PLANS.items():
    add(f"plan-raw-{_name}", "plan", lambda d, t=_text: ["plan", "validate", write(d, "p.json", t)], "p.json")

# plan files: one field wrong ------------------------------------------------------------------------------
PLAN_FIELDS = [
    ("no-schema", "schema_version", DELETE, "schema_version"),
    ("schema-3", "schema_version", 3, "schema_version"),
    ("schema-str", "schema_version", "1", "schema_version"),
    ("schema-float", "schema_version", 1.0, "schema_version"),
    ("schema-bool", "schema_version", True, "schema_version"),
    ("unknown-top", "colour", "red", "colour"),
    ("no-layers", "layers", DELETE, "layers"),
    ("layers-empty", "layers", [], "layers"),
    ("layers-object", "layers", {}, "layers"),
    ("layers-string", "layers", "all", "layers"),
    ("model-list", "model", [], "model"),
    ("model-no-layers", "model.num_layers", DELETE, "model.num_layers"),
    ("model-layers-0", "model.num_layers", 0, "model.num_layers"),
    ("model-layers-str", "model.num_layers", "2", "model.num_layers"),
    ("model-layers-disagree", "model.num_layers", 3, "model.num_layers"),
    ("model-head-dim-neg", "model.head_dim", -1, "model.head_dim"),
    ("model-kv-0", "model.num_kv_heads", 0, "model.num_kv_heads"),
    ("model-extra", "model.colour", 1, "model.colour"),
    ("model-name-int", "model.name", 5, "model.name"),
    ("model-fp-int", "model.fingerprint", 5, "model.fingerprint"),
    ("trigger-list", "trigger", [], "trigger"),
    ("slack-0", "trigger.decode_slack", 0, "trigger.decode_slack"),
    ("slack-neg", "trigger.decode_slack", -1, "trigger.decode_slack"),
    ("slack-str", "trigger.decode_slack", "x", "trigger.decode_slack"),
    ("slack-float", "trigger.decode_slack", 1.5, "trigger.decode_slack"),
    ("trigger-extra", "trigger.when", 1, "trigger.when"),
    ("prov-extra", "provenance.author", "me", "provenance.author"),
    ("prov-context-0", "provenance.context_tokens", 0, "provenance.context_tokens"),
    ("prov-bytes-neg", "provenance.predicted_bytes", -1, "provenance.predicted_bytes"),
    ("prov-loss-str", "provenance.predicted_loss", "low", "provenance.predicted_loss"),
    ("prov-note-int", "provenance.note", 3, "provenance.note"),
    ("layer-not-object", "layers.1", 7, "layers[1]"),
    ("layer-no-index", "layers.1.layer", DELETE, "layers[1].layer"),
    ("layer-wrong-index", "layers.1.layer", 5, "layers[1].layer"),
    ("layer-no-prefill", "layers.1.prefill", DELETE, "layers[1].prefill"),
    ("layer-no-decode", "layers.1.decode", DELETE, "layers[1].decode"),
    ("prefill-string", "layers.0.prefill", "snapkv", "layers[0].prefill"),
    ("rule-missing", "layers.0.prefill.rule", DELETE, "layers[0].prefill.rule"),
    ("rule-empty", "layers.0.prefill.rule", "", "layers[0].prefill.rule"),
    ("rule-int", "layers.0.prefill.rule", 5, "layers[0].prefill.rule"),
    ("rule-unknown", "layers.0.prefill.rule", "magic", "layers[0].prefill.rule"),
    ("rule-wrong-phase", "layers.1.decode.rule", "snapkv", "layers[1].decode.rule"),
    ("capacity-0", "layers.0.prefill.capacity", 0, "layers[0].prefill.capacity"),
    ("capacity-neg", "layers.0.prefill.capacity", -5, "layers[0].prefill.capacity"),
    ("capacity-str", "layers.0.prefill.capacity", "10", "layers[0].prefill.capacity"),
    ("capacity-float", "layers.0.prefill.capacity", 1.5, "layers[0].prefill.capacity"),
    ("capacity-bool", "layers.0.prefill.capacity", True, "layers[0].prefill.capacity"),
    ("capacity-and-ratio", "layers.0.prefill.capacity_ratio", 0.5, "layers[0].prefill.capacity"),
    ("ratio-0", "layers.1.decode.capacity_ratio", 0, "layers[1].decode.capacity_ratio"),
    ("ratio-above-1", "layers.1.decode.capacity_ratio", 1.5, "layers[1].decode.capacity_ratio"),
    ("ratio-neg", "layers.1.decode.capacity_ratio", -0.1, "layers[1].decode.capacity_ratio"),
    ("ratio-str", "layers.1.decode.capacity_ratio", "half", "layers[1].decode.capacity_ratio"),
    ("no-capacity", "layers.1.decode.capacity_ratio", DELETE, "layers[1].decode.capacity"),
    ("full-with-capacity", "layers.0.decode.capacity", 8, "layers[0].decode.capacity"),
    ("op-extra-key", "layers.0.prefill.budget", 3, "layers[0].prefill.budget"),
    ("params-list", "layers.0.prefill.params", [], "layers[0].prefill.params"),
    ("params-unknown", "layers.0.prefill.params.colour", 1, "layers[0].prefill.params"),
    ("k-bits-3", "layers.0.k_bits", 3, "layers[0].k_bits"),
    ("k-bits-32", "layers.0.k_bits", 32, "layers[0].k_bits"),
    ("k-bits-str", "layers.0.k_bits", "8", "layers[0].k_bits"),
    ("v-bits-1", "layers.0.v_bits", 1, "layers[0].v_bits"),
    ("quantizer-unknown", "layers.0.quantizer", "gptq", "layers[0].quantizer"),
    ("quantizer-int", "layers.0.quantizer", 5, "layers[0].quantizer"),
    ("qparams-list", "layers.0.quantizer_params", [], "layers[0].quantizer_params"),
    ("qparams-unknown", "layers.0.quantizer_params", {"colour": 1}, "layers[0].quantizer_params"),
    ("qparams-group-0", "layers.0.quantizer_params", {"group_size": 0}, "layers[0].quantizer_params"),
    ("qparams-residual", "layers.0.quantizer_params", {"group_size": 32, "residual": 48},
     "layers[0].quantizer_params"),
    ("layer-extra-key", "layers.0.colour", 1, "layers[0].colour"),
]
# rule parameter values (declared types and ranges)
PARAM_VALUES = [
    ("snapkv", "window", v, tag) for v, tag in ((-3, "neg"), (0, "zero"), ("abc", "str"), (1e300, "huge"),
                                                 (True, "bool"), (None, "null"), (1.5, "float"), (2 ** 40, "big"))
] + [("snapkv", "kernel_size", 0, "zero"), ("snapkv", "pooling", "median", "unknown"), ("snapkv", "pooling", 3, "int"),
     ("h2o", "recent_ratio", 2, "above"), ("h2o", "recent_ratio", -1, "neg"), ("h2o", "recent_ratio", "x", "str"),
     ("h2o", "normalize", "yes", "str"), ("h2o", "normalize", 1, "int"), ("streamingllm", "n_sink", -1, "neg"),
     ("streamingllm", "n_sink", "4", "str"), ("streamingllm", "n_sink", 1.5, "float"),
     ("triattention", "max_offset", 0, "zero"), ("triattention", "max_offset", 1e300, "huge")]
for rule, param, value, tag in PARAM_VALUES:
    layer, phase = (0, "prefill") if rule == "snapkv" else (1, "decode")
    op = {"rule": rule, "capacity": 32, "params": {param: value}}
    PLAN_FIELDS.append((f"param-{rule}-{param}-{tag}", f"layers.{layer}.{phase}", op,
                        f"layers[{layer}].{phase}.params.{param}"))

# wrappers (cam, adakv): the inner rule and its parameters are checked like the rule's own fields
WRAPPER_INNER = [
    ("cam", "unknown", {"rule": "magic"}, "params.rule'"),
    ("cam", "self", {"rule": "cam"}, "params.rule'"),
    ("cam", "full", {"rule": "full"}, "params.rule'"),
    ("cam", "int", {"rule": 7}, "params.rule'"),
    ("cam", "params-list", {"rule": "h2o", "rule_params": [1]}, "params.rule_params'"),
    ("cam", "params-unknown", {"rule": "h2o", "rule_params": {"colour": 1}}, "params.rule_params'"),
    ("cam", "params-value", {"rule": "snapkv", "rule_params": {"window": -3}}, "params.rule_params.window'"),
    ("cam", "params-type", {"rule": "streamingllm", "rule_params": {"n_sink": "4"}}, "params.rule_params.n_sink'"),
    ("adakv", "unknown", {"rule": "magic"}, "params.rule'"),
    ("adakv", "not-scored", {"rule": "cam"}, "params.rule'"),
    ("adakv", "params-value", {"rule": "snapkv", "rule_params": {"kernel_size": 0}}, "params.rule_params.kernel_size'"),
]
for wrapper, tag, params, field in WRAPPER_INNER:
    PLAN_FIELDS.append((f"{wrapper}-inner-{tag}", "layers.0.prefill", {"rule": wrapper, "capacity": 32, "params": params},
                        f"layers[0].prefill.{field}"))
# a wrapper runs where its inner rule runs: CaM around SnapKV (prefill only) in the decode phase
PLAN_FIELDS.append(("cam-inner-wrong-phase", "layers.1.decode",
                    {"rule": "cam", "capacity": 32, "params": {"rule": "snapkv"}}, "layers[1].decode.params'"))

for _id, _path, _value, _expect in PLAN_FIELDS:
    def _setup(d, p=_path, v=_value):
        plan = mutate(plan_dict(), p, None, delete=True) if v is DELETE else mutate(plan_dict(), p, v)
        return ["plan", "validate", write(d, "p.json", plan)]
    add(f"plan-{_id}", "plan", _setup, _expect)

# plans against a model
add("plan-model-layers", "plan", lambda d: ["plan", "validate", str(SHIPPED_PLAN), "--model", model_folder(d)],
    "field 'layers'")
add("plan-model-kv-heads", "plan", lambda d: ["plan", "validate", write(d, "p.json", plan_dict()), "--model",
                                              model_folder(d, kv_heads=1, heads=4)], "model.num_kv_heads")
add("plan-model-head-dim", "plan", lambda d: ["plan", "validate", write(d, "p.json", plan_dict()), "--model",
                                              model_folder(d, head_dim=64)], "model.head_dim")
add("plan-model-fingerprint", "plan", lambda d: ["plan", "validate", write(
    d, "p.json", mutate(plan_dict(), "model.fingerprint", "cfg-000000000000+s-000000000000")), "--model",
    model_folder(d)], "model.fingerprint")
add("plan-model-group-size", "plan", lambda d: ["plan", "show", write(
    d, "p.json", mutate(mutate(plan_dict(), "model.head_dim", 16), "layers.0.quantizer_params", {"group_size": 32})),
    "--model", model_folder(d, head_dim=16)], "quantizer_params")
add("plan-show-no-model", "plan", lambda d: ["plan", "show", write(d, "p.json", mutate(plan_dict(), "model", None))],
    "--model")
add("plan-model-missing", "plan", lambda d: ["plan", "validate", write(d, "p.json", plan_dict()), "--model",
                                             str(d / "nope")], "--model")
add("plan-model-file", "plan", lambda d: ["plan", "validate", write(d, "p.json", plan_dict()), "--model",
                                          write(d, "m.txt", "x")], "--model")
add("plan-model-no-config", "plan", lambda d: (os.mkdir(d / "empty"), ["plan", "validate", write(
    d, "p.json", plan_dict()), "--model", str(d / "empty")])[1], "--model")
for _ctx, _tag in (("0", "zero"), ("-1", "neg"), ("1e30", "float"), ("99999999999999999999", "huge"),
                   ("abc", "text")):
    add(f"plan-show-context-{_tag}", "plan", lambda d, c=_ctx: ["plan", "show", write(d, "p.json", plan_dict()),
                                                                "--context", c], "--context")


# plan paths
def _fifo(d: Path, name: str = "fifo.json") -> str:
    os.mkfifo(d / name)
    return str(d / name)


def _loop(d: Path) -> str:
    os.symlink(d / "loop-b", d / "loop-a")
    os.symlink(d / "loop-a", d / "loop-b")
    return str(d / "loop-a")


add("plan-path-missing", "plan", lambda d: ["plan", "validate", str(d / "none.json")], "none.json")
add("plan-path-folder", "plan", lambda d: ["plan", "validate", str(d)], str("folder"))
add("plan-path-fifo", "plan", lambda d: ["plan", "validate", _fifo(d)], "fifo.json")
add("plan-path-loop", "plan", lambda d: ["plan", "show", _loop(d)], "loop-a")
add("plan-path-dangling", "plan", lambda d: (os.symlink(d / "gone", d / "dangling.json"),
                                             ["plan", "validate", str(d / "dangling.json")])[1], "dangling.json")


# profiles (through `polykv solve`) -------------------------------------------------------------------------
def _solve(d: Path, profile: Any, *extra: str) -> list[str]:
    return ["solve", write(d, "prof.json", profile), "--budget", "4x", "--context", "256", "-o", "out.plan.json",
            *extra]


RAW_PROFILES = {"empty": "", "open-brace": "{", "list": "[]", "latin1": b'{"x": "\xe9"}', "nan": '{"a": NaN}',
                "binary": bytes(range(256))}
for _name, _text in RAW_PROFILES.items():
    add(f"profile-raw-{_name}", "profile", lambda d, t=_text: _solve(d, t), "prof.json", ("out.plan.json",))

PROFILE_FIELDS = [
    ("no-schema", "schema_version", DELETE, "schema_version"),
    ("schema-3", "schema_version", 3, "schema_version"),
    ("format-plan", "format", "polykv-plan", "format"),
    ("unknown-top", "colour", 1, "colour"),
    ("no-model", "model", DELETE, "model"),
    ("model-list", "model", [], "model"),
    ("model-layers-0", "model.num_layers", 0, "model"),
    ("model-layers-str", "model.num_layers", "2", "model"),
    ("configs-object", "configs", {}, "configs"),
    ("config-int", "configs.0", 3, "configs[0]"),
    ("config-no-keep", "configs.1.keep", DELETE, "configs[1].keep"),
    ("config-keep-0", "configs.1.keep", 0, "configs"),
    ("config-keep-above", "configs.1.keep", 1.5, "configs"),
    ("config-keep-str", "configs.1.keep", "half", "configs[1].keep"),
    ("config-bits-str", "configs.1.k_bits", "8", "configs[1].k_bits"),
    ("config-rule-int", "configs.1.rule", 3, "configs[1].rule"),
    ("metrics-list", "metrics", [], "metrics"),
    ("metric-row-short", "metrics.l2.0", [0.1], "metrics.l2"),
    ("metric-value-str", "metrics.l2.0.0", "x", "metrics.l2[0][0]"),
    ("metric-one-layer", "metrics.l2", [[0.1] * 8], "metrics.l2"),
    ("metric-empty", "metrics.l2", [], "metrics.l2"),
    ("stats-list", "stats", [], "stats"),
    ("stat-no-columns", "stats.cos", {"values": [[1], [1]], "higher_is_better": True}, "stats.cos"),
    ("stat-hib-str", "stats.cos", {"columns": ["snapkv"], "values": [[1], [1]], "higher_is_better": "yes"},
     "stats.cos.higher_is_better"),
    ("stat-capacity-0", "stats.cos", {"columns": ["snapkv"], "values": [[1], [1]], "higher_is_better": True,
                                      "capacity": 0}, "stats.cos.capacity"),
    ("prov-extra", "provenance.author", "me", "provenance"),
]
for _id, _path, _value, _expect in PROFILE_FIELDS:
    def _setup(d, p=_path, v=_value):
        prof = mutate(profile_dict(), p, None, delete=True) if v is DELETE else mutate(profile_dict(), p, v)
        return _solve(d, prof)
    add(f"profile-{_id}", "profile", _setup, _expect, ("out.plan.json",))

add("profile-path-missing", "profile", lambda d: ["solve", str(d / "none.json"), "--budget", "4x", "--context", "256",
                                                  "-o", "out.plan.json"], "none.json", ("out.plan.json",))
add("profile-path-folder", "profile", lambda d: ["solve", str(d), "--budget", "4x", "--context", "256", "-o",
                                                 "out.plan.json"], "folder", ("out.plan.json",))
add("profile-path-fifo", "profile", lambda d: ["solve", _fifo(d), "--budget", "4x", "--context", "256", "-o",
                                               "out.plan.json"], "fifo.json", ("out.plan.json",))
add("profile-wrong-model", "profile", lambda d: _solve(d, profile_dict(), "--model", model_folder(d, layers=3)),
    "model", ("out.plan.json",))

# solve arguments
SOLVE_ARGS = [
    ("budget-empty", ["--budget", ""], "budget"), ("budget-text", ["--budget", "abc"], "budget"),
    ("budget-0x", ["--budget", "0x"], "ratio"), ("budget-half", ["--budget", "0.5x"], "ratio"),
    ("budget-neg", ["--budget", "-8x"], "budget"), ("budget-1e21GiB", ["--budget", "1e21GiB"], "budget"),
    ("budget-unit", ["--budget", "8y"], "budget"), ("budget-nan", ["--budget", "nanx"], "budget"),
    ("budget-inf", ["--budget", "infx"], "budget"), ("budget-fraction-bytes", ["--budget", "0.5b"], "budget"),
    ("budget-tiny", ["--budget", "1b"], "budget"),
    ("context-0", ["--context", "0"], "context"), ("context-neg", ["--context", "-5"], "context"),
    ("context-text", ["--context", "abc"], "--context"), ("context-huge", ["--context", "99999999999999999999"],
                                                          "context"),
    ("solver-unknown", ["--solver", "magic"], "magic"), ("param-no-eq", ["--param", "rule"], "--param"),
    ("param-nan", ["--param", "x=NaN"], "--param"), ("param-inf", ["--param", "x=Infinity"], "--param"),
    ("param-unknown", ["--param", "colour=1"], "colour"), ("param-rule-unknown", ["--param", "rules=[\"magic\"]"],
                                                           "magic"),
    ("param-metric", ["--param", "metric=kl"], "kl"),
]
for _id, _args, _expect in SOLVE_ARGS:
    def _setup(d, a=_args):
        argv = _solve(d, profile_dict())
        for i in range(0, len(a), 2):
            if a[i] in argv:
                argv[argv.index(a[i]) + 1] = a[i + 1]
            else:
                argv += a[i:i + 2]
        return argv
    add(f"solve-{_id}", "cli", _setup, _expect, ("out.plan.json",))

add("solve-output-is-profile", "cli", lambda d: ["solve", write(d, "prof.json", profile_dict()), "--budget", "4x",
                                                 "--context", "256", "-o", str(d / "prof.json")], "-o")
add("solve-output-via-symlink", "cli", lambda d: (write(d, "prof.json", profile_dict()),
                                                  os.symlink(d / "prof.json", d / "link.json"),
                                                  ["solve", str(d / "prof.json"), "--budget", "4x", "--context", "256",
                                                   "-o", str(d / "link.json")])[2], "-o")
add("solve-output-foreign", "cli", lambda d: _solve(d, profile_dict())[:-1] + [write(d, "notes.txt", "my notes")],
    "notes.txt")
add("solve-output-folder", "cli", lambda d: _solve(d, profile_dict())[:-1] + [str(d)], "-o")
add("solve-output-under-file", "cli", lambda d: _solve(d, profile_dict())[:-1] + [
    os.path.join(write(d, "notes.txt", "x"), "plan.json")], "notes.txt")
add("solve-output-dangling", "cli", lambda d: (os.symlink(d / "gone", d / "dl.json"),
                                               _solve(d, profile_dict())[:-1] + [str(d / "dl.json")])[1], "dl.json")
add("solve-model-missing", "cli", lambda d: _solve(d, profile_dict(), "--model", str(d / "nope")), "--model",
    ("out.plan.json",))


# study specs (through `polykv study --check`) ----------------------------------------------------------------
def _study(d: Path, spec: Any, *extra: str, plan: Any = None) -> list[str]:
    write(d, "plan.json", plan if plan is not None else plan_dict())
    write(d, "prof.json", profile_dict())
    return ["study", write(d, "spec.json", spec), "--check", "--results", str(d / "r.jsonl"), *extra]


RAW_SPECS = {"empty": "", "open-brace": "{", "list": "[]", "latin1": b'{"name": "\xe9"}', "nan": '{"seed": NaN}',
             "fifo": None}
for _name, _text in RAW_SPECS.items():
    if _text is None:
        add("spec-raw-fifo", "spec", lambda d: ["study", _fifo(d, "spec.json"), "--check", "--results",
                                                str(d / "r.jsonl")], "spec.json", ("r.jsonl",))
    else:
        add(f"spec-raw-{_name}", "spec", lambda d, t=_text: _study(d, t), "spec.json", ("r.jsonl",))

SOLVERS = [{"name": "mine2", "solver": "exact"}]
SPEC_FIELDS = [
    ("unknown-top", "colour", 1, "colour"),
    ("model-big", "model", "big", "model"),
    ("model-tiny-int", "model", {"tiny": 5}, "model"),
    ("model-other", "model", {"huge": {}}, "model"),
    ("model-tiny-bad", "model", {"tiny": {"family": "gpt9"}}, "model"),
    ("dtype", "dtype", "fp8", "dtype"),
    ("context-0", "context_tokens", 0, "context_tokens"),
    ("context-neg", "context_tokens", -1, "context_tokens"),
    ("context-str", "context_tokens", "x", "context_tokens"),
    ("context-float", "context_tokens", 1e30, "context_tokens"),
    ("context-huge", "context_tokens", 10 ** 30, "context_tokens"),
    ("budgets-string", "budgets", "8x", "budgets"),
    ("budgets-unit", "budgets", ["8y"], "budgets[0]"),
    ("budgets-huge", "budgets", ["1e21GiB"], "budgets[0]"),
    ("budgets-duplicate", "budgets", ["8x", "8x"], "budgets"),
    ("plans-list", "plans", ["plan.json"], "plans"),
    ("plans-missing-file", "plans", {"mine": "none.json"}, "plans.mine"),
    ("plans-folder", "plans", {"mine": "."}, "plans.mine"),
    ("plans-int", "plans", {"mine": 5}, "plans.mine"),
    ("profile-missing", "profile", "none.json", "profile"),
    ("profile-is-plan", "profile", "plan.json", "profile"),
    ("solvers-object", "solvers", {}, "solvers"),
    ("solver-int", "solvers", [3], "solvers[0]"),
    ("solver-no-name", "solvers", [{"solver": "exact"}], "solvers[0].name"),
    ("solver-name-at", "solvers", [{"name": "a@b", "solver": "exact"}], "solvers[0].name"),
    ("solver-unknown", "solvers", [{"name": "a", "solver": "magic"}], "solvers[0].solver"),
    ("solver-params", "solvers", [{"name": "a", "solver": "exact", "params": {"colour": 1}}], "solvers[0].params"),
    ("solver-role", "solvers", [{"name": "a", "solver": "exact", "role": "king"}], "solvers[0].role"),
    ("solver-count", "solvers", [{"name": "a", "solver": "exact", "count": 2}], "solvers[0].count"),
    ("solver-extra", "solvers", [{"name": "a", "solver": "exact", "colour": 1}], "solvers[0].colour"),
    ("solver-no-profile", "profile", DELETE, "profile"),
    ("solver-no-budget", "budgets", DELETE, "budgets"),
    ("baseline-str", "baseline", "yes", "baseline"),
    ("reuse-int", "reuse_prefill", 1, "reuse_prefill"),
    ("chunk-0", "chunk_size", 0, "chunk_size"),
    ("tasks-missing", "tasks", DELETE, "tasks"),
    ("tasks-empty", "tasks", [], "tasks"),
    ("task-int", "tasks.0", 3, "tasks[0]"),
    ("task-unknown", "tasks.0.task", "sudoku", "tasks[0].task"),
    ("task-param-unknown", "tasks.0.params.colour", 1, "tasks[0].params.colour"),
    ("task-samples-0", "tasks.0.samples", 0, "tasks[0].samples"),
    ("task-samples-str", "tasks.0.samples", "2", "tasks[0].samples"),
    ("task-seed-neg", "tasks.0.seed", -1, "tasks[0].seed"),
    ("task-extra", "tasks.0.colour", 1, "tasks[0].colour"),
    ("no-policy", "plans", {}, "plans"),
]
TASK_VALUES = [
    ("length", 0), ("length", "x"), ("length", 1e300), ("length", 10 ** 12), ("depth", 2), ("depth", "x"),
    ("digits", 0), ("digits", 100), ("filler", "poems"), ("max_new_tokens", 0), ("max_new_tokens", -1),
    ("max_new_tokens", 1.5), ("max_new_tokens", None),
]
for _param, _value in TASK_VALUES:
    SPEC_FIELDS.append((f"passkey-{_param}-{_value}", f"tasks.0.params.{_param}", _value, _param))

for _id, _path, _value, _expect in SPEC_FIELDS:
    def _setup(d, p=_path, v=_value, i=_id):
        spec = spec_dict()
        if i.startswith(("solver", "budgets")):
            spec.update(profile="prof.json", budgets=["4x"], solvers=list(SOLVERS))
        spec = mutate(spec, p, None, delete=True) if v is DELETE else mutate(spec, p, v)
        if i == "no-policy":
            spec["baseline"] = False
        return _study(d, spec)
    add(f"spec-{_id}", "spec", _setup, _expect, ("r.jsonl",))

OTHER_TASKS = [
    ("niah-queries", {"task": "niah", "params": {"num_keys": 1, "num_queries": 2}}, "num_queries"),
    ("niah-keys-0", {"task": "niah", "params": {"num_keys": 0}}, "num_keys"),
    ("vt-hops-neg", {"task": "variable_tracking", "params": {"num_hops": -1}}, "num_hops"),
    ("continuation-0", {"task": "continuation", "params": {"context_tokens": 0}}, "context_tokens"),
    ("continuation-kind", {"task": "continuation", "params": {"kind": "poems"}}, "kind"),
    ("continuation-no-baseline", {"task": "continuation"}, "baseline"),
    ("duplicate-task", None, "tasks"),
]
for _id, _task, _expect in OTHER_TASKS:
    def _setup(d, t=_task, i=_id):
        spec = spec_dict()
        if t is None:
            spec["tasks"] = spec["tasks"] * 2
        else:
            spec["tasks"] = [t]
        if i == "continuation-no-baseline":
            spec["baseline"] = False
        return _study(d, spec)
    add(f"spec-task-{_id}", "spec", _setup, _expect, ("r.jsonl",))

add("spec-plan-other-model", "spec", lambda d: _study(
    d, mutate(spec_dict(), "plans.mine", str(SHIPPED_PLAN))), SHIPPED_PLAN.name, ("r.jsonl",))

# results and report paths of a study
add("study-results-is-spec", "spec", lambda d: _study(d, spec_dict())[:-1] + [str(d / "spec.json")], "--results")
add("study-results-is-plan", "spec", lambda d: _study(d, spec_dict())[:-1] + [str(d / "plan.json")], "--results")
add("study-results-one-line-notes", "spec", lambda d: _study(d, spec_dict())[:-1] + [
    write(d, "notes.txt", "remember the milk")], "notes.txt")
add("study-results-notes", "spec", lambda d: _study(d, spec_dict())[:-1] + [
    write(d, "notes.txt", "line one\nline two\n")], "notes.txt")
add("study-results-folder", "spec", lambda d: _study(d, spec_dict())[:-1] + [str(d)], "--results")
add("study-results-other-study", "spec", lambda d: _study(d, spec_dict())[:-1] + [write_jsonl(d, "other.jsonl", [
    {"format": "polykv-study-results", "kind": "header", "spec": {}, "spec_hash": "spec-0", "version": 1},
    {"kind": "result", "policy": "full", "task": "passkey", "item": "passkey-0", "score": 1.0}])], "another study")
add("study-report-is-spec", "spec", lambda d: _study(d, spec_dict(), "--report", str(d / "spec.json")), "--report",
    ("r.jsonl",))
add("study-report-foreign", "spec", lambda d: (write(d, "rep/report.md", "# my own notes\n"),
                                               _study(d, spec_dict(), "--report", str(d / "rep")))[1], "report.md",
    ("r.jsonl",))


def _locked(d: Path) -> list[str]:
    from polykv.studies.results import ResultsLock

    argv = _study(d, spec_dict())
    _HELD.append(ResultsLock.acquire(str(d / "r.jsonl")))
    return argv


_HELD: list = []
add("study-results-locked", "spec", _locked, "another polykv study is writing", ("r.jsonl",))


# task files ------------------------------------------------------------------------------------------------
def _file_study(d: Path, task: str, lines: list[Any], raw: bytes | None = None, **params) -> list[str]:
    path = write(d, "items.jsonl", raw) if raw is not None else write_jsonl(d, "items.jsonl", lines)
    spec = spec_dict()
    spec["tasks"] = [{"task": task, "params": {"path": path, **params}, "samples": 2, "seed": 0}]
    return _study(d, spec)


LB_BAD = [
    ("not-json", ["{oops"], "line 1"), ("not-object", ["[1, 2]"], "line 1"),
    ("missing-field", [{k: v for k, v in longbench_line(0).items() if k != "answers"}], "answers"),
    ("context-int", [longbench_line(0, context=5)], "context"),
    ("context-empty", [longbench_line(0, context="")], "context"),
    ("answers-str", [longbench_line(0, answers="Paris")], "answers"),
    ("answers-empty", [longbench_line(0, answers=[])], "answers"),
    ("duplicate-id", [longbench_line(0), longbench_line(1, _id="id0")], "_id"),
    ("unknown-dataset", [longbench_line(0, dataset="klingon_qa")], "klingon_qa"),
    ("classes-str", [longbench_line(0, all_classes="a")], "all_classes"),
    ("nan", ['{"context": NaN}'], "line 1"),
    ("too-few", [longbench_line(0)], "items"),
]
for _id, _lines, _expect in LB_BAD:
    add(f"taskfile-longbench-{_id}", "taskfile", lambda d, ls=_lines: _file_study(d, "longbench_file", ls),
        _expect, ("r.jsonl",))
add("taskfile-longbench-latin1", "taskfile", lambda d: _file_study(d, "longbench_file", [], raw=b'{"x": "\xe9"}\n'),
    "UTF-8", ("r.jsonl",))
add("taskfile-longbench-missing", "taskfile", lambda d: (lambda a: (os.unlink(d / "items.jsonl"), a)[1])(
    _file_study(d, "longbench_file", [longbench_line(0)])), "items.jsonl", ("r.jsonl",))
add("taskfile-longbench-fifo", "taskfile", lambda d: (lambda a: (os.unlink(d / "items.jsonl"), _fifo(d, "items.jsonl"),
                                                                a)[2])(_file_study(d, "longbench_file", [])),
    "items.jsonl", ("r.jsonl",))
add("taskfile-longbench-metric", "taskfile", lambda d: _file_study(d, "longbench_file", [longbench_line(0)],
                                                                   metric="bleu"), "metric", ("r.jsonl",))
RULER_BAD = [
    ("missing-field", [{k: v for k, v in ruler_line(0).items() if k != "outputs"}], "outputs"),
    ("no-separator", [ruler_line(0, input="one line only")], "input"),
    ("empty-context", [ruler_line(0, input="\nWhat is the number?")], "input"),
    ("outputs-empty", [ruler_line(0, outputs=[])], "outputs"),
    ("duplicate-index", [ruler_line(0), ruler_line(1, index=0)], "index"),
]
for _id, _lines, _expect in RULER_BAD:
    add(f"taskfile-ruler-{_id}", "taskfile", lambda d, ls=_lines: _file_study(d, "ruler_file", ls), _expect,
        ("r.jsonl",))
add("taskfile-ruler-max-new-0", "taskfile", lambda d: _file_study(d, "ruler_file", [ruler_line(0), ruler_line(1)],
                                                                  max_new_tokens=0), "max_new_tokens", ("r.jsonl",))
add("taskfile-ruler-metric", "taskfile", lambda d: _file_study(d, "ruler_file", [ruler_line(0), ruler_line(1)],
                                                               metric="bleu"), "metric", ("r.jsonl",))
add("taskfile-ruler-latin1", "taskfile", lambda d: _file_study(d, "ruler_file", [], raw=b'{"input": "\xe9"}\n'),
    "UTF-8", ("r.jsonl",))


# other CLI arguments -----------------------------------------------------------------------------------------
def _results_file(d: Path) -> str:
    return write_jsonl(d, "r.jsonl", [
        {"format": "polykv-study-results", "kind": "header", "spec": {"name": "x"}, "spec_hash": "spec-0",
         "version": 1}])


CLI_ARGS = [
    ("unknown-verb", lambda d: ["frobnicate"], "frobnicate"),
    ("solve-no-args", lambda d: ["solve"], "required"),
    ("plan-no-action", lambda d: ["plan"], "required"),
    ("plan-validate-no-file", lambda d: ["plan", "validate"], "plan"),
    ("report-no-output", lambda d: ["report", _results_file(d)], "-o"),
    ("report-into-results", lambda d: ["report", _results_file(d), "-o", str(d / "r.jsonl")], "-o"),
    ("report-missing-results", lambda d: ["report", str(d / "none.jsonl"), "-o", str(d / "rep")], "none.jsonl"),
    ("report-foreign-results", lambda d: ["report", write(d, "notes.txt", "hello\nworld\n"), "-o", str(d / "rep")],
     "notes.txt"),
    ("report-results-folder", lambda d: ["report", str(d), "-o", str(d / "rep")], "folder"),
    ("report-output-file", lambda d: ["report", _results_file(d), "-o", write(d, "notes.txt", "x")], "-o"),
    ("report-output-foreign-md", lambda d: (write(d, "rep/report.md", "# mine\n"),
                                            ["report", _results_file(d), "-o", str(d / "rep")])[1], "report.md"),
    ("calibrate-missing-model", lambda d: ["calibrate", str(d / "nope"), "-o", "x.profile.json"], "nope"),
    ("calibrate-no-config", lambda d: (os.mkdir(d / "m"), ["calibrate", str(d / "m"), "-o", "x.profile.json"])[1],
     "config.json"),
    ("demo-samples-0", lambda d: ["demo", "--samples", "0", "--out", str(d / "demo")], "--samples"),
    ("demo-out-file", lambda d: ["demo", "--out", write(d, "notes.txt", "x")], "--out"),
    ("demo-out-foreign-spec", lambda d: (write(d, "demo/spec.json", {"name": "mine"}),
                                         ["demo", "--out", str(d / "demo")])[1], "spec.json"),
    ("study-threads-0", lambda d: _study(d, spec_dict(), "--threads", "0")[:-5] + ["--results", str(d / "r.jsonl"),
                                                                                   "--threads", "0"], "--threads"),
]
for _id, _setup, _expect in CLI_ARGS:
    add(f"cli-{_id}", "cli", _setup, _expect, ("rep", "x.profile.json"))

CALIBRATE_ARGS = [
    ("prefix-0", ["--prefix", "0"], "--prefix"), ("tokens-le-prefix", ["--tokens", "64", "--prefix", "64"], "--tokens"),
    ("sequences-0", ["--sequences", "0"], "--sequences"), ("bits-3", ["--bits", "16,8,3"], "--bits"),
    ("bits-text", ["--bits", "16,x"], "--bits"), ("bits-half", ["--bits", "8.5"], "--bits"),
    ("keeps-0", ["--keeps", "0,1"], "--keeps"), ("keeps-above", ["--keeps", "0.5,1.5"], "--keeps"),
    ("keeps-nan", ["--keeps", "nan"], "--keeps"), ("keeps-empty", ["--keeps", ","], "--keeps"),
    ("device-cuda", ["--device", "cuda"], "--device"), ("device-nonsense", ["--device", "toaster"], "--device"),
    ("dtype-fp8", ["--dtype", "fp8"], "--dtype"), ("dtype-fp16-cpu", ["--dtype", "fp16"], "--dtype"),
    ("stat-capacity-0", ["--stat-capacity", "0"], "--stat-capacity"), ("threads-0", ["--threads", "0"], "--threads"),
    ("delta-ppl-too-many", ["--delta-ppl", "9", "--sequences", "2"], "--delta-ppl"),
    ("validate-neg", ["--validate", "-1"], "--validate"), ("validate-configs-0", ["--validate-configs", "0"],
                                                           "--validate-configs"),
    ("rules-unknown", ["--rules", "magic"], "magic"), ("rules-empty", ["--rules", ","], "--rules"),
    ("rules-wrong-phase", ["--rules", "snapkv", "--phase", "decode"], "snapkv"),
    ("quantizer-unknown", ["--quantizer", "gptq"], "gptq"),
    ("qparam-group-0", ["--quantizer-param", "group_size=0"], "group_size"),
    ("qparam-unknown", ["--quantizer-param", "colour=1"], "colour"),
    ("qparam-no-eq", ["--quantizer-param", "group_size"], "--quantizer-param"),
    ("prefix-text", ["--prefix", "many"], "--prefix"),
]
for _id, _args, _expect in CALIBRATE_ARGS:
    add(f"calibrate-{_id}", "cli", lambda d, a=_args: ["calibrate", model_folder(d), "-o", "x.profile.json", *a],
        _expect, ("x.profile.json", "x.qstats.safetensors"))
add("calibrate-head-dim-16", "cli", lambda d: ["calibrate", model_folder(d, head_dim=16), "-o", "x.profile.json"],
    "group_size", ("x.profile.json",))
add("calibrate-output-config", "cli", lambda d: ["calibrate", model_folder(d), "-o", str(d / "model" / "config.json")],
    "-o")
add("calibrate-output-foreign", "cli", lambda d: ["calibrate", model_folder(d), "-o", write(d, "notes.txt", "x")],
    "notes.txt", ("notes.qstats.safetensors",))
add("calibrate-stats-foreign", "cli", lambda d: ["calibrate", model_folder(d), "-o", "x.profile.json",
                                                 "--query-stats", write(d, "notes.safetensors", "x")], "--query-stats",
    ("x.profile.json",))
add("calibrate-stats-is-profile", "cli", lambda d: ["calibrate", model_folder(d), "-o", "x.profile.json",
                                                    "--query-stats", "x.profile.json"], "--query-stats",
    ("x.profile.json",))
add("calibrate-partial-file", "cli", lambda d: ["calibrate", model_folder(d), "-o", "x.profile.json"] + [
    "--no-progress"][:0] + (write(d, "x.profile.json.partial", "x") and []), "partial", ("x.profile.json",))


# -- further tables ----------------------------------------------------------------------------------
# Each ``cases_<area>.py`` beside this file adds its own cases with ``add``/``case`` from here; they are
# imported last, in name order, so every area keeps its cases in its own file.
def _load_area_tables() -> None:
    import importlib

    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        importlib.import_module(path.stem)


_load_area_tables()
