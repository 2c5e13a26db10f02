"""Plan files: deterministic JSON writing and strict parsing with precise errors (validation against the
plugins and the model: :mod:`polykv.plan.validation`).

Every error is a :class:`polykv.errors.PlanError` naming the file, the layer (when there is one)
and the dotted field, and saying what to do.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from polykv.atomic import write_text_atomic
from polykv.errors import PlanError
from polykv.plan import (BUDGET_KINDS, DEFAULT_QUANTIZER, FULL_RULE, MAX_BATCH, MAX_BUDGET_VALUE, MAX_CONTEXT_TOKENS,
                         MAX_LOSS, OPTIONAL_PROVENANCE, PASSTHROUGH_BITS, RANK_SCHEMA_VERSION, SCHEMA_VERSION,
                         SHARE_SCHEMA_VERSION, LayerPlan, ModelInfo, OpSpec,
                         Plan, Provenance, TriggerSettings)
from polykv.strict_json import FieldReader

PHASES = ("prefill", "decode")


# -- writing --------------------------------------------------------------------------------------

def _op_dict(op: OpSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": op.rule}
    if op.capacity is not None:
        out["capacity"] = op.capacity
    if op.capacity_ratio is not None:
        out["capacity_ratio"] = op.capacity_ratio
    if op.params:
        out["params"] = dict(sorted(op.params.items()))
    return out


def layer_dict(lp: LayerPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"layer": lp.layer, "prefill": _op_dict(lp.prefill), "decode": _op_dict(lp.decode),
                           "k_bits": lp.k_bits, "v_bits": lp.v_bits, "quantizer": lp.quantizer}
    if lp.quantizer_params:
        out["quantizer_params"] = dict(sorted(lp.quantizer_params.items()))
    if lp.share is not None:  # schema version 2 (polykv.plan.sharing)
        out["share"] = lp.share
    if lp.share_params:
        out["share_params"] = dict(sorted(lp.share_params.items()))
    for name in RANK_FIELDS:  # written only when set: a full-rank layer's line is what version 1 wrote
        if getattr(lp, name) is not None:
            out[name] = getattr(lp, name)
    return out


RANK_FIELDS = ("k_rank", "v_rank")
"""Layer fields of schema version 2: channels of the stored key and value codes (absent = full rank)."""


def plan_dict(plan: Plan, folder: str | None = None) -> dict[str, Any]:
    """The plan as JSON data; ``model_data`` paths relative to ``folder`` when given (the plan file's folder)."""
    from polykv.plan.groups import groups_to_json

    out = {
        "schema_version": plan.written_schema_version,
        "model": attrs.asdict(plan.model) if plan.model else None,
        "trigger": attrs.asdict(plan.trigger),
        "provenance": {k: v for k, v in attrs.asdict(plan.provenance).items()
                       if v is not None or k not in OPTIONAL_PROVENANCE},
        "layers": [layer_dict(lp) for lp in plan.layers],
    }
    if plan.allocation:
        out["allocation"] = groups_to_json(plan.allocation)
    if plan.model_data:
        out["model_data"] = {k: _relative(v, folder) for k, v in sorted(plan.model_data.items())}
    return out


def _relative(path: str, folder: str | None) -> str:
    """``path`` as written in a plan file in ``folder`` (forward slashes); unchanged without a folder."""
    if folder is None:
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(folder)).replace(os.sep, "/")


def _resolved(plan: Plan, source: str) -> Plan:
    """A loaded plan with its ``model_data`` paths resolved against the plan file's folder."""
    if not plan.model_data:
        return plan
    folder = os.path.dirname(os.path.abspath(source))
    return attrs.evolve(plan, model_data={k: os.path.normpath(os.path.join(folder, v))
                                          for k, v in plan.model_data.items()})


def _check_json(value: Any, field: str) -> None:
    """Refuse what a plan file cannot hold (a set, an object), naming its field, before any JSON is written."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(v, f"{field}.{k}" if field else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{field}[{i}]")
    else:
        raise PlanError(f"{field} holds a {type(value).__name__} ({value!r}), which a plan file cannot hold",
                        field=field, hint="give a number, a string, true/false, null, a list or a mapping")


def dumps(plan: Plan, folder: str | None = None) -> str:
    """Stable text: one top-level field per line, one layer per line, trailing newline."""
    d = plan_dict(plan, folder)
    _check_json(d, "")
    enc = lambda v: json.dumps(v, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)  # noqa: E731
    lines = ["{"]
    for key in ("schema_version", "model", "trigger", "provenance", "allocation", "model_data"):
        if key in d:
            lines.append(f'  "{key}": {enc(d[key])},')
    lines.append('  "layers": [')
    rows = [f"    {enc(row)}" for row in d["layers"]]
    lines.append(",\n".join(rows))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save(plan: Plan, path: str) -> None:
    write_text_atomic(path, dumps(plan, os.path.dirname(os.path.abspath(path))))


def is_plan_file(path: str) -> bool:
    """True when ``path`` holds a JSON object shaped like a plan (``schema_version`` and ``layers``)."""
    from polykv.atomic import read_json_head

    raw = read_json_head(path)
    return isinstance(raw, dict) and "schema_version" in raw and "layers" in raw


# -- reading --------------------------------------------------------------------------------------

def parse_plan_text(text: str, source: str = "<plan>") -> Plan:
    """Parse plan JSON text strictly (no registry or model checks)."""
    return parse_plan_dict(FieldReader(source, PlanError).parse(text), source)


def parse_plan_dict(raw: Any, source: str = "<plan>") -> Plan:
    r = FieldReader(source, PlanError)
    if not isinstance(raw, dict):
        r.fail(f"a plan must be a JSON object, got {type(raw).__name__}")
    if "schema_version" not in raw:
        r.fail("missing required key", field="schema_version", hint=f"plans written by polykv carry "
               f"\"schema_version\": {SCHEMA_VERSION}")
    version = raw["schema_version"]
    if type(version) is not int or version not in (SCHEMA_VERSION, SHARE_SCHEMA_VERSION):  # 1.0, true: not 1
        r.fail(f"unknown schema version {version!r}; this polykv reads versions {SCHEMA_VERSION} and "
               f"{SHARE_SCHEMA_VERSION}", field="schema_version", hint="upgrade polykv or re-save the plan with this version")
    r.obj(raw, "", ["schema_version", "layers"], ["model", "trigger", "provenance", "allocation", "model_data"])
    model = _parse_model(r, raw.get("model"))
    trigger = _parse_trigger(r, raw.get("trigger"))
    prov = _parse_provenance(r, raw.get("provenance"))
    layers_raw = r.list_(raw["layers"], "layers", nonempty=True, what="a non-empty list of layer entries")
    layers = [_parse_layer(r, i, entry) for i, entry in enumerate(layers_raw)]
    _check_rank_version(r, version, layers, model)
    if model is not None and model.num_layers != len(layers):
        r.fail(f"the plan lists {len(layers)} layers but model.num_layers is {model.num_layers}",
               field="model.num_layers", hint="give exactly one entry per layer")
    from polykv.plan.groups import check_groups, parse_groups

    plan = Plan(layers=layers, model=model, trigger=trigger, provenance=prov, schema_version=version,
                allocation=parse_groups(r, raw.get("allocation")), model_data=_parse_model_data(r, raw.get("model_data")))
    check_groups(plan, source=source)
    _check_version_fields(r, plan)
    from polykv.plan.sharing import check_shares

    check_shares(plan, source=source)
    return plan


def _check_rank_version(r: FieldReader, version: int, layers: list[LayerPlan], model: ModelInfo | None) -> None:
    """Ranks need schema version 2 and fit the plan's head dim."""
    for lp in layers:
        for name in RANK_FIELDS:
            rank = getattr(lp, name)
            if rank is None:
                continue
            field = f"layers[{lp.layer}].{name}"
            if version < RANK_SCHEMA_VERSION:
                r.fail(f"'{name}' is a schema version {RANK_SCHEMA_VERSION} field but the file says version {version}",
                       layer=lp.layer, field=field, hint=f"set \"schema_version\": {RANK_SCHEMA_VERSION}, or remove "
                       f"the rank (full rank)")
            if model is not None and rank > model.head_dim:
                r.fail(f"rank {rank} exceeds the head dim {model.head_dim}", layer=lp.layer, field=field,
                       hint=f"use a rank in 1..{model.head_dim}, or remove it for full rank")
def _check_version_fields(r: FieldReader, plan: Plan) -> None:
    """A version-1 file holds no field of version 2 (``share``)."""
    if plan.schema_version == SCHEMA_VERSION:
        for lp in plan.layers:
            if lp.share is not None or lp.share_params:
                r.fail(f"share needs schema_version {SHARE_SCHEMA_VERSION}, but the file says {SCHEMA_VERSION}",
                       layer=lp.layer, field=f"layers[{lp.layer}].share",
                       hint=f"set \"schema_version\": {SHARE_SCHEMA_VERSION} (polykv writes it for plans that share)")


def _parse_model(r: FieldReader, raw: Any) -> ModelInfo | None:
    if raw is None:
        return None
    r.obj(raw, "model", ["num_layers", "num_kv_heads", "head_dim"], ["name", "fingerprint"])
    return ModelInfo(num_layers=r.int_(raw["num_layers"], "model.num_layers", minimum=1),
                     num_kv_heads=r.int_(raw["num_kv_heads"], "model.num_kv_heads", minimum=1),
                     head_dim=r.int_(raw["head_dim"], "model.head_dim", minimum=1),
                     name=r.str_(raw.get("name", ""), "model.name"),
                     fingerprint=r.str_(raw.get("fingerprint"), "model.fingerprint", optional=True))


def _parse_model_data(r: FieldReader, raw: Any) -> dict[str, str]:
    """``model_data``: data key -> file (a non-empty path, relative to the plan file's folder)."""
    if raw is None:
        return {}
    r.dict_(raw, "model_data")
    for key, path in raw.items():
        if not key:
            r.fail("the data key is empty", field="model_data", hint="name the data a rule reads, e.g. \"triattention\"")
        if not isinstance(path, str) or not path:
            r.fail(f"expected a non-empty file path, got {path!r}", field=f"model_data.{key}",
                   hint="e.g. \"triattention\": \"../profiles/x.qstats.safetensors\" (relative to the plan file)")
    return dict(raw)


def _parse_trigger(r: FieldReader, raw: Any) -> TriggerSettings:
    if raw is None:
        return TriggerSettings()
    r.obj(raw, "trigger", optional=["decode_slack"])
    return TriggerSettings(decode_slack=r.int_(raw.get("decode_slack", 128), "trigger.decode_slack", minimum=1))


def _parse_provenance(r: FieldReader, raw: Any) -> Provenance:
    from polykv.memory.budgets import BASES, STORAGE_DTYPE_BYTES

    if raw is None:
        return Provenance()
    r.obj(raw, "provenance", optional=[f.name for f in attrs.fields(Provenance)])
    f = "provenance."
    return Provenance(
        solver=r.str_(raw.get("solver"), f + "solver", optional=True),
        params=r.dict_(raw.get("params", {}), f + "params"),
        budget=_budget(r, raw.get("budget"), f + "budget"),
        context_tokens=r.int_(raw.get("context_tokens"), f + "context_tokens", minimum=1,
                              maximum=MAX_CONTEXT_TOKENS, optional=True),
        predicted_loss=r.float_(raw.get("predicted_loss"), f + "predicted_loss", optional=True, minimum=0.0,
                                maximum=MAX_LOSS),
        predicted_bytes=r.int_(raw.get("predicted_bytes"), f + "predicted_bytes", minimum=0,
                               maximum=MAX_BUDGET_VALUE, optional=True),
        profile_fingerprint=r.str_(raw.get("profile_fingerprint"), f + "profile_fingerprint", optional=True),
        polykv_version=r.str_(raw.get("polykv_version"), f + "polykv_version", optional=True),
        created=_created(r, raw.get("created"), f + "created"),
        note=r.str_(raw.get("note", ""), f + "note"),
        basis=_choice(r, raw.get("basis"), f + "basis", BASES, "basis"),
        batch=r.int_(raw.get("batch"), f + "batch", minimum=1, maximum=MAX_BATCH, optional=True),
        cache_dtype=_choice(r, raw.get("cache_dtype"), f + "cache_dtype", tuple(STORAGE_DTYPE_BYTES), "cache dtype"),
        measured=r.dict_(raw.get("measured"), f + "measured", optional=True),
    )


def _choice(r: FieldReader, value: Any, field: str, choices: tuple[str, ...], what: str) -> str | None:
    return None if value is None else r.choice(r.str_(value, field), field, choices, what)


def _budget(r: FieldReader, value: Any, field: str) -> dict | None:
    """``{"ratio": 8.0}``, ``{"bytes": N}`` or ``{"tokens_per_layer": N}``: one kind, a positive finite value."""
    budget = r.dict_(value, field, optional=True)
    if budget is None:
        return None
    if len(budget) != 1 or next(iter(budget)) not in BUDGET_KINDS:
        r.fail(f"expected one budget kind, got {sorted(budget)}", field=field,
               hint="e.g. {\"ratio\": 8.0}, {\"bytes\": 1048576} or {\"tokens_per_layer\": 256}")
    kind, amount = next(iter(budget.items()))
    r.float_(amount, f"{field}.{kind}", minimum=1, maximum=MAX_BUDGET_VALUE)
    return budget


def _created(r: FieldReader, value: Any, field: str) -> str | None:
    import datetime

    created = r.str_(value, field, optional=True)
    if created is not None:
        try:
            datetime.datetime.fromisoformat(created)
        except ValueError:
            r.fail(f"expected an ISO-8601 time like \"2026-01-31T12:00:00+00:00\", got {created!r}", field=field,
                   hint="write the time polykv writes, or leave the field out")
    return created


def _parse_op(r: FieldReader, layer: int, phase: str, raw: Any) -> OpSpec:
    field = f"layers[{layer}].{phase}"
    r.obj(raw, field, ["rule"], ["capacity", "capacity_ratio", "params"], layer=layer)
    rule = r.str_(raw["rule"], field + ".rule", layer=layer)
    if not rule:
        r.fail("rule name is empty", layer=layer, field=field + ".rule")
    cap = raw.get("capacity")
    ratio = raw.get("capacity_ratio")
    cap = r.int_(cap, field + ".capacity", layer=layer, optional=True)
    ratio = r.float_(ratio, field + ".capacity_ratio", layer=layer, optional=True)
    params = r.dict_(raw.get("params", {}), field + ".params", layer=layer)
    op = OpSpec(rule=rule, capacity=cap, capacity_ratio=ratio, params=params)
    check_op(op, layer=layer, phase=phase, source=r.source)
    return op


def check_op(op: OpSpec, *, layer: int, phase: str, source: str) -> None:
    """Capacity rules every op obeys, whatever rule it names."""
    field = f"layers[{layer}].{phase}"
    if op.rule == FULL_RULE:
        if op.capacity is not None or op.capacity_ratio is not None:
            raise PlanError("rule 'full' keeps everything and takes no capacity", source=source, layer=layer,
                            field=field + ".capacity", hint="remove the capacity or name a retention rule")
        return
    if (op.capacity is None) == (op.capacity_ratio is None):
        raise PlanError(f"rule '{op.rule}' needs exactly one of 'capacity' (tokens) or 'capacity_ratio'",
                        source=source, layer=layer, field=field + ".capacity",
                        hint="e.g. \"capacity\": 256 or \"capacity_ratio\": 0.25")
    if op.capacity is not None and op.capacity < 1:
        raise PlanError(f"capacity must be a positive number of tokens, got {op.capacity}", source=source,
                        layer=layer, field=field + ".capacity", hint="use at least 1, or rule 'full'")
    if op.capacity_ratio is not None and not (0.0 < op.capacity_ratio <= 1.0):
        raise PlanError(f"capacity_ratio must be in (0, 1], got {op.capacity_ratio}", source=source,
                        layer=layer, field=field + ".capacity_ratio", hint="e.g. 0.25 keeps a quarter")


def _parse_layer(r: FieldReader, i: int, raw: Any) -> LayerPlan:
    field = f"layers[{i}]"
    r.obj(raw, field, ["layer", "prefill", "decode"], ["k_bits", "v_bits", "quantizer", "quantizer_params", "share",
                                                       "share_params", *RANK_FIELDS], layer=i)
    idx = r.int_(raw["layer"], field + ".layer", layer=i)
    if idx != i:
        r.fail(f"entry {i} says layer {idx}", layer=i, field=field + ".layer",
               hint="list layers in order, 0 to L-1, each exactly once")
    kb = r.int_(raw.get("k_bits", PASSTHROUGH_BITS), field + ".k_bits", layer=i)
    vb = r.int_(raw.get("v_bits", PASSTHROUGH_BITS), field + ".v_bits", layer=i)
    for name, bits in (("k_bits", kb), ("v_bits", vb)):
        if bits not in (2, 4, 8, 16):
            r.fail(f"unsupported bit width {bits}", layer=i, field=f"{field}.{name}",
                   hint="use 16 (unquantized), 8, 4 or 2")
    return LayerPlan(
        layer=i,
        prefill=_parse_op(r, i, "prefill", raw["prefill"]),
        decode=_parse_op(r, i, "decode", raw["decode"]),
        k_bits=kb, v_bits=vb,
        quantizer=r.str_(raw.get("quantizer", DEFAULT_QUANTIZER), field + ".quantizer", layer=i),
        quantizer_params=r.dict_(raw.get("quantizer_params", {}), field + ".quantizer_params", layer=i),
        share=r.int_(raw.get("share"), field + ".share", layer=i, minimum=0, optional=True),
        share_params=r.dict_(raw.get("share_params", {}), field + ".share_params", layer=i),
        **{name: r.int_(raw[name], f"{field}.{name}", layer=i, minimum=1) for name in RANK_FIELDS if name in raw},
    )


def load(path: str, *, registry=None, geometry=None) -> Plan:
    source = str(path)
    raw = FieldReader(source, PlanError).read("plan file", missing_hint="check the path",
                                              text_hint="give a plan file (JSON)")
    plan = _resolved(parse_plan_dict(raw, source), source)
    if registry is not None or geometry is not None:
        from polykv.plan.validation import validate

        validate(plan, registry=registry, geometry=geometry, source=source)
    return plan
