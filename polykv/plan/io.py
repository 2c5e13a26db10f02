"""Plan files, read: strict parsing with precise errors, and :func:`load_plan` (validation against the plugins and
the model: :mod:`polykv.plan.validation`; writing: :mod:`polykv.plan.writing`).

Every error is a :class:`polykv.errors.PlanError` naming the file, the layer (when there is one)
and the dotted field, and saying what to do.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import attrs

from polykv.errors import PlanError
from polykv.plan.groups import check_groups, parse_groups
from polykv.plan.records import (BASES, BUDGET_KINDS, DEFAULT_QUANTIZER, MAX_BATCH, MAX_BUDGET_VALUE,
                                 MAX_CONTEXT_TOKENS, MAX_LOSS, PASSTHROUGH_BITS, RANK_SCHEMA_VERSION, SCHEMA_VERSION,
                                 SHARE_SCHEMA_VERSION, STORAGE_DTYPE_BYTES, LayerPlan, ModelInfo, OpSpec, Plan, Provenance,
                                 TriggerSettings)
from polykv.plan.sharing import check_shares
from polykv.plan.validation import check_op, validate_plan
from polykv.plan.writing import RANK_FIELDS
from polykv.strict_json import FieldReader, read_json_head


def _resolved(plan: Plan, source: str) -> Plan:
    """A loaded plan with its ``model_data`` paths resolved against the plan file's folder."""
    folder = os.path.dirname(os.path.abspath(source))
    return attrs.evolve(plan, model_data={k: os.path.normpath(os.path.join(folder, v))
                                          for k, v in plan.model_data.items()})


def is_plan_file(path: str) -> bool:
    """True when ``path`` holds a JSON object shaped like a plan (``schema_version`` and ``layers``)."""
    raw = read_json_head(path)
    return isinstance(raw, dict) and "schema_version" in raw and "layers" in raw


# -- reading --------------------------------------------------------------------------------------

def parse_plan_text(text: str, source: str = "<plan>") -> Plan:
    """Parse plan JSON text strictly (no registry or model checks)."""
    return parse_plan_dict(FieldReader(source, PlanError).parse(text), source)


def parse_plan_dict(raw: Any, source: str = "<plan>", *, reader: FieldReader | None = None) -> Plan:
    """A plan from parsed plan-file JSON, checked strictly; an optional section (allocation groups, shared pairs,
    ranks, per-model data) is read and checked when the file gives it (``null`` is leaving it out)."""
    r = reader or FieldReader(source, PlanError)
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
    if any(lp.low_rank for lp in layers):
        _check_rank_version(r, version, layers, model)
    if model is not None and model.num_layers != len(layers):
        r.fail(f"the plan lists {len(layers)} layers but model.num_layers is {model.num_layers}",
               field="model.num_layers", hint="give exactly one entry per layer")
    groups, data = raw.get("allocation"), raw.get("model_data")
    plan = Plan(layers=layers, model=model, trigger=trigger, provenance=prov, schema_version=version,
                allocation=() if groups is None else parse_groups(r, groups),
                model_data={} if data is None else _parse_model_data(r, data))
    if plan.allocation:
        check_groups(plan, source=source)
    if plan.shares:
        _check_version_fields(r, plan)
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
    """Where the plan came from; a budget, a time and the basis fields are read when given (a hand-made plan's
    are null or absent)."""
    if raw is None:
        return Provenance()
    r.obj(raw, "provenance", optional=[f.name for f in attrs.fields(Provenance)])
    f = "provenance."
    given = {key for key in ("budget", "created", "basis", "cache_dtype") if raw.get(key) is not None}
    return Provenance(
        solver=r.str_(raw.get("solver"), f + "solver", optional=True),
        params=r.dict_(raw.get("params", {}), f + "params"),
        budget=_budget(r, raw["budget"], f + "budget") if "budget" in given else None,
        context_tokens=r.int_(raw.get("context_tokens"), f + "context_tokens", minimum=1,
                              maximum=MAX_CONTEXT_TOKENS, optional=True),
        predicted_loss=r.float_(raw.get("predicted_loss"), f + "predicted_loss", optional=True, minimum=0.0,
                                maximum=MAX_LOSS),
        predicted_bytes=r.int_(raw.get("predicted_bytes"), f + "predicted_bytes", minimum=0,
                               maximum=MAX_BUDGET_VALUE, optional=True),
        profile_fingerprint=r.str_(raw.get("profile_fingerprint"), f + "profile_fingerprint", optional=True),
        polykv_version=r.str_(raw.get("polykv_version"), f + "polykv_version", optional=True),
        created=_created(r, raw["created"], f + "created") if "created" in given else None,
        note=r.str_(raw.get("note", ""), f + "note"),
        basis=_choice(r, raw["basis"], f + "basis", BASES, "basis") if "basis" in given else None,
        batch=r.int_(raw.get("batch"), f + "batch", minimum=1, maximum=MAX_BATCH, optional=True),
        cache_dtype=_choice(r, raw["cache_dtype"], f + "cache_dtype", tuple(STORAGE_DTYPE_BYTES), "cache dtype")
        if "cache_dtype" in given else None,
        measured=r.dict_(raw.get("measured"), f + "measured", optional=True),
    )


def _choice(r: FieldReader, value: Any, field: str, choices: tuple[str, ...], what: str) -> str:
    return r.choice(r.str_(value, field), field, choices, what)


def _budget(r: FieldReader, value: Any, field: str) -> dict:
    """``{"ratio": 8.0}``, ``{"bytes": N}`` or ``{"tokens_per_layer": N}``: one kind, a positive finite value."""
    budget = r.dict_(value, field)
    if len(budget) != 1 or next(iter(budget)) not in BUDGET_KINDS:
        r.fail(f"expected one budget kind, got {sorted(budget)}", field=field,
               hint="e.g. {\"ratio\": 8.0}, {\"bytes\": 1048576} or {\"tokens_per_layer\": 256}")
    kind, amount = next(iter(budget.items()))
    r.float_(amount, f"{field}.{kind}", minimum=1, maximum=MAX_BUDGET_VALUE)
    return budget


def _created(r: FieldReader, value: Any, field: str) -> str:
    created = r.str_(value, field)
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


def load_plan(path: str, *, registry=None, geometry=None) -> Plan:
    """Read a plan file; checks syntax, schema and, when given, the registry and model geometry."""
    source = str(path)
    r = FieldReader(source, PlanError)
    plan = parse_plan_dict(r.read("plan file", missing_hint="check the path", text_hint="give a plan file (JSON)"),
                           source, reader=r)
    if plan.model_data:
        plan = _resolved(plan, source)
    if registry is not None or geometry is not None:
        validate_plan(plan, registry=registry, geometry=geometry, source=source)
    return plan
