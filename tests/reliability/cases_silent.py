"""Inputs that cannot be right but used to be accepted without a word: KVzip's token-id lists and sink, ``refine``'s
held-out context and option names, repeated ``--param`` keys, a report's ``--profile`` of another model. Each is
refused in one line naming the layer, field or option."""

from __future__ import annotations

from cases import add, model_folder, mutate, plan_dict, profile_dict, write

IDS = {"repeat_ids": [5, 6], "continue_ids": [7], "suffix_ids": [8]}


def _rule_plan(rule: str, params: dict, capacity: int = 64) -> dict:
    return mutate(plan_dict(), "layers.0.prefill", {"rule": rule, "capacity": capacity, "params": params})


def _validate(plan: dict, *extra: str):
    return lambda d: ["plan", "validate", write(d, "p.json", plan), *extra]


# -- token-id lists of kvzip: every list, every way a list of token ids can be wrong ---------------------------
BAD_IDS = {"empty": [], "negative": [5, -1], "float": [5, 1.5], "bool": [True], "string": "5 6",
           "nested": [[5]], "past-int32": [1 << 40], "null-item": [5, None]}
for _name in ("repeat_ids", "continue_ids", "suffix_ids"):
    for _kind, _value in BAD_IDS.items():
        if _name != "repeat_ids" and _kind not in ("empty", "negative"):
            continue
        if _name == "suffix_ids" and _kind == "empty":   # no assistant header is a valid header
            continue
        add(f"silent-kvzip-{_name.replace('_', '-')}-{_kind}", "plan",
            _validate(_rule_plan("kvzip", dict(IDS, **{_name: _value}))), f"layers[0].prefill.params.{_name}")

# neighbouring integer parameters of the same rules (kvzip, kvzip-head, expected-attention, keydiff)
INTS = [("kvzip", "chunk_size", 0), ("kvzip", "chunk_size", 2.5), ("kvzip", "carry_tokens", -1),
        ("kvzip", "n_sink", -1), ("kvzip", "prefix_tokens", "4"), ("kvzip-head", "n_sink", -2),
        ("kvzip-head", "prefix_tokens", 1.5), ("expected-attention", "n_future_positions", 0),
        ("expected-attention", "query_buffer", []), ("expected-attention", "n_sink", -1),
        ("keydiff", "block_size", -1), ("keydiff", "block_size", [4])]
for _rule, _name, _value in INTS:
    _params = dict(IDS) if _rule == "kvzip" else {}
    add(f"silent-{_rule}-{_name.replace('_', '-')}-{type(_value).__name__}-{str(_value).strip('[]') or 'empty'}",
        "plan", _validate(_rule_plan(_rule, dict(_params, **{_name: _value}))), f"layers[0].prefill.params.{_name}")

# the kvzip allocators take no parameters
for _alloc in ("kvzip", "kvzip-head"):
    _rule = "kvzip" if _alloc == "kvzip" else "kvzip-head"
    _op = {"rule": _rule, "capacity": 16, "params": dict(IDS) if _rule == "kvzip" else {}}
    _plan = mutate(mutate(plan_dict(), "layers.0.prefill", _op), "layers.1.prefill", _op)
    _plan["allocation"] = [{"allocator": _alloc, "layers": [0, 1], "params": {"chunk_size": 8}}]
    add(f"silent-{_alloc}-allocator-param", "plan", _validate(_plan), "allocation[0].params")

# -- sinks the capacity cannot hold: the prefix (sink="prefix") or kvzip-head's n_sink kept in every head ----------
add("silent-kvzip-prefix-sink-over-capacity", "plan",
    _validate(_rule_plan("kvzip", dict(IDS, sink="prefix", prefix_tokens=100))), "layers[0].prefill.params.prefix_tokens")
add("silent-kvzip-head-prefix-sink-over-capacity", "plan",
    _validate(_rule_plan("kvzip-head", {"sink": "prefix", "prefix_tokens": 65})), "layers[0].prefill.params.prefix_tokens")
add("silent-kvzip-head-n-sink-over-capacity", "plan",
    _validate(_rule_plan("kvzip-head", {"n_sink": 80})), "layers[0].prefill.params.n_sink")


# -- solve: repeated --param keys, refine's held-out context past the model's positions --------------------------
def _solve(d, *extra):
    return ["solve", write(d, "prof.json", profile_dict()), "--budget", "2x", "--context", "256",
            "-o", "out.plan.json", *extra]


add("silent-solve-param-repeated", "cli", lambda d: _solve(d, "--param", "metric=l2", "--param", "metric=kl"),
    "--param metric", outputs=("out.plan.json",))
add("silent-solve-param-repeated-same-value", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d), "--param", "steps=2", "--param", "steps=2"),
    "--param steps", outputs=("out.plan.json",))
add("silent-solve-quantizer-param-repeated", "cli",
    lambda d: _solve(d, "--quantizer", "kivi", "--quantizer-param", "group_size=32", "--quantizer-param",
                     "group_size=64"), "--quantizer-param group_size", outputs=("out.plan.json",))
add("silent-calibrate-quantizer-param-repeated", "cli",
    lambda d: ["calibrate", model_folder(d), "-o", "x.profile.json", "--quantizer-param", "group_size=32",
               "--quantizer-param", "group_size=32"], "--quantizer-param group_size", outputs=("x.profile.json",))
add("silent-refine-tokens-past-positions", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d, max_position_embeddings=128),
                     "--tokens", "4096"), "--tokens", outputs=("out.plan.json",))
add("silent-refine-param-tokens-past-positions", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d, max_position_embeddings=128),
                     "--param", "tokens=200"), "--param tokens", outputs=("out.plan.json",))
add("silent-refine-follow-up-past-positions", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d, max_position_embeddings=128),
                     "--tokens", "64", "--param", "follow_up=100"), "--param follow_up", outputs=("out.plan.json",))
add("silent-refine-sequences-past-corpus", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d), "--tokens", "64",
                     "--param", "sequences=100000"), "--param sequences", outputs=("out.plan.json",))
add("silent-refine-validate-past-corpus", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d), "--tokens", "64",
                     "--param", "validate=100000"), "--param validate", outputs=("out.plan.json",))


# -- report --profile of another model than the study's ------------------------------------------------------------
def _report(d, profile: dict, **plan_model):
    from cases_files import good_results

    import json

    path = good_results(d, plan=True)
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    for rec in lines:
        if rec.get("kind") == "policy" and rec.get("plan"):
            rec["plan"]["model"].update(plan_model)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(rec) + "\n" for rec in lines))
    return ["report", path, "-o", str(d / "rep"), "--profile", write(d, "prof.json", profile)]


add("silent-report-profile-other-head-dim", "cli", lambda d: _report(d, profile_dict(), head_dim=64), "--profile",
    outputs=("rep",))
add("silent-report-profile-other-fingerprint", "cli", lambda d: _report(
    d, mutate(profile_dict(), "model.fingerprint", "cfg-111111111111+s-111111111111"),
    fingerprint="cfg-222222222222+s-222222222222"), "--profile", outputs=("rep",))
