"""Plan files in, checked plans out: strict reading (:func:`load_plan`, :func:`parse_plan_dict`) and the checks of a
plan against the plugins and the model (:func:`validate_plan`; writing: :mod:`polykv.plan.writing`).

Every rule, allocator and quantizer a plan names exists and takes its parameters, and the layers fit the model's
geometry. The optional sections are read and checked only when a plan has them: allocation groups
(:mod:`polykv.plan.groups`), shared pairs (:mod:`polykv.plan.sharing`), ranks (:mod:`polykv.plan.ranks`), per-model
data (:mod:`polykv.plan.side_files`) and a solver's provenance (:mod:`polykv.plan.provenance`). Every error is a
:class:`polykv.errors.PlanError` naming the file, the layer (when there is one) and the dotted field, and saying
what to do.
"""

from __future__ import annotations

import warnings
from typing import Any

from polykv.contract.params import UncheckedParamsWarning, unchecked_params
from polykv.errors import PlanError, RegistryError
from polykv.models.geometry import fingerprints_match
from polykv.plan.groups import check_groups, parse_groups
from polykv.plan.provenance import NO_PROVENANCE, parse_provenance
from polykv.plan.ranks import check_code_widths, check_rank_version, check_ranks
from polykv.plan.records import (DEFAULT_QUANTIZER, FULL_RULE, PASSTHROUGH_BITS, PHASES, SCHEMA_VERSION,
                                 SHARE_SCHEMA_VERSION, LayerPlan, ModelInfo, OpSpec, Plan, Provenance, TriggerSettings)
from polykv.plan.sharing import check_share_version, check_shares
from polykv.plan.side_files import check_bases_file, check_model_data_keys, parse_model_data, resolve_model_data
from polykv.plan.writing import RANK_FIELDS
from polykv.strict_json import FieldReader, read_json_head


def load_plan(path: str, *, registry=None, geometry=None) -> Plan:
    """Read a plan file; checks syntax, schema and, when given, the registry and model geometry."""
    source = str(path)
    r = FieldReader(source, PlanError)
    plan = parse_plan_dict(r.read("plan file", missing_hint="check the path", text_hint="give a plan file (JSON)"),
                           source, reader=r)
    if plan.model_data:
        plan = resolve_model_data(plan, source)
    if registry is not None or geometry is not None:
        validate_plan(plan, registry=registry, geometry=geometry, source=source)
    return plan


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
    prov = raw.get("provenance")    # a hand-made plan's is the empty one: nothing to read
    prov = Provenance() if prov is None or prov == NO_PROVENANCE else parse_provenance(r, prov)
    layers_raw = r.list_(raw["layers"], "layers", nonempty=True, what="a non-empty list of layer entries")
    layers = [_parse_layer(r, i, entry) for i, entry in enumerate(layers_raw)]
    if any(lp.low_rank for lp in layers):
        check_rank_version(r, version, layers, model)
    if model is not None and model.num_layers != len(layers):
        r.fail(f"the plan lists {len(layers)} layers but model.num_layers is {model.num_layers}",
               field="model.num_layers", hint="give exactly one entry per layer")
    groups, data = raw.get("allocation"), raw.get("model_data")
    plan = Plan(layers=layers, model=model, trigger=trigger, provenance=prov, schema_version=version,
                allocation=() if groups is None else parse_groups(r, groups),
                model_data={} if data is None else parse_model_data(r, data))
    if plan.allocation:
        check_groups(plan, source=source)
    if plan.shares:
        check_share_version(plan, source=source)
        check_shares(plan, source=source)
    return plan


def _parse_model(r: FieldReader, raw: Any) -> ModelInfo | None:
    if raw is None:
        return None
    r.obj(raw, "model", ["num_layers", "num_kv_heads", "head_dim"], ["name", "fingerprint"])
    return ModelInfo(num_layers=r.int_(raw["num_layers"], "model.num_layers", minimum=1),
                     num_kv_heads=r.int_(raw["num_kv_heads"], "model.num_kv_heads", minimum=1),
                     head_dim=r.int_(raw["head_dim"], "model.head_dim", minimum=1),
                     name=r.str_(raw.get("name", ""), "model.name"),
                     fingerprint=r.str_(raw.get("fingerprint"), "model.fingerprint", optional=True))


def _parse_trigger(r: FieldReader, raw: Any) -> TriggerSettings:
    if raw is None:
        return TriggerSettings()
    r.obj(raw, "trigger", optional=["decode_slack"])
    return TriggerSettings(decode_slack=r.int_(raw.get("decode_slack", 128), "trigger.decode_slack", minimum=1))


def _parse_op(r: FieldReader, layer: int, phase: str, raw: Any) -> OpSpec:
    field = f"layers[{layer}].{phase}"
    r.obj(raw, field, ["rule"], ["capacity", "capacity_ratio", "params"], layer=layer)
    rule = r.str_(raw["rule"], field + ".rule", layer=layer)
    if not rule:
        r.fail("rule name is empty", layer=layer, field=field + ".rule")
    cap = r.int_(raw.get("capacity"), field + ".capacity", layer=layer, optional=True)
    ratio = r.float_(raw.get("capacity_ratio"), field + ".capacity_ratio", layer=layer, optional=True)
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


# -- checking -------------------------------------------------------------------------------------

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


def validate_plan(plan: Plan, *, registry=None, geometry=None, source: str = "<plan>") -> Plan:
    """Check op capacities, names and params against ``registry`` and shape against ``geometry``; returns ``plan``.

    Parameters of rules, quantizers and allocators are checked against their ``param_specs``; a
    given parameter its plugin declares no spec for is reported once per plugin as an
    :class:`~polykv.contract.params.UncheckedParamsWarning` (its value is checked only when the plugin runs).
    """
    for lp in plan.layers:
        for phase in PHASES:
            check_op(getattr(lp, phase), layer=lp.layer, phase=phase, source=source)
    unchecked: dict[str, set[str]] = {}
    # groups, pairs, per-model data and ranks are checked when the plan has them (a plain plan has none)
    if plan.allocation:
        check_groups(plan, source=source)
        if registry is not None:
            check_group_allocators(plan, registry, source=source, unchecked=unchecked)
    if plan.shares:
        check_shares(plan, source=source, geometry=geometry)
    if registry is not None:
        _validate_registry(plan, registry, source, unchecked)
        if plan.model_data:
            check_model_data_keys(plan, registry, source)
    if geometry is not None:
        validate_geometry(plan, geometry, source)
    elif plan.model is not None and plan.low_rank:
        check_ranks(plan, plan.model.head_dim, source)
    if unchecked:
        _warn_unchecked(unchecked, source)
    return plan


def check_group_allocators(plan: Plan, registry, *, source: str, unchecked: dict[str, set[str]] | None = None) -> None:
    """Every group's allocator is registered, takes its params, and can budget its members' ops (parameters
    without a spec are added to ``unchecked``)."""
    unchecked = {} if unchecked is None else unchecked
    for gi, g in enumerate(plan.allocation):
        field = f"allocation[{gi}]"
        try:
            cls = registry.allocator(g.allocator)
        except RegistryError as exc:
            raise PlanError(str(exc), source=source, field=field + ".allocator") from None
        allocator = plugin_instance(cls, g.params, source=source, layer=g.layers[0], field=field + ".params",
                                    unchecked=unchecked, hint=f"fix the value; the group holds layers {list(g.layers)}")
        for layer in g.layers:
            for phase in PHASES:
                problem = allocator.check_op(getattr(plan.layers[layer], phase))
                if problem is not None:
                    where, reason = problem
                    raise PlanError(f"{reason} (allocation group {field}, {g.describe()})", source=source,
                                    layer=layer, field=f"layers[{layer}].{phase}.{where}",
                                    hint=f"set layers[{layer}].{phase}.{where} and {field}.{where} to one value")


def plugin_instance(cls, params, *, source: str, layer: int | None, field: str, unchecked: dict[str, set[str]],
                    hint: str = "fix the value (see `polykv plugins`)"):
    """``cls(**params)`` for a plan's rule, quantizer or allocator: a refused value is one PlanError naming
    the parameter (``field.<name>``); given names without a spec are added to ``unchecked``."""
    try:
        obj = cls(**params)
    except (TypeError, ValueError) as exc:
        param = getattr(exc, "param", None)
        raise PlanError(str(exc), source=source, layer=layer, field=field + (f".{param}" if param else ""),
                        hint=hint if param else None) from None
    names = unchecked_params(cls, params)
    if names:
        owner = f"{getattr(cls, 'plugin_kind', 'plugin')} '{getattr(cls, 'name', cls.__name__)}'"
        unchecked.setdefault(owner, set()).update(names)
    return obj


def _warn_unchecked(unchecked: dict[str, set[str]], source: str) -> None:
    for owner, names in sorted(unchecked.items()):
        warnings.warn(f"{source}: {owner} declares no param_specs for {sorted(names)}: their values are not checked "
                      "until it runs (its author can declare a ParamSpec per parameter)", UncheckedParamsWarning,
                      stacklevel=4)


def _validate_registry(plan: Plan, registry, source: str, unchecked: dict[str, set[str]]) -> None:
    for lp in plan.layers:
        for phase in PHASES:
            op = getattr(lp, phase)
            field = f"layers[{lp.layer}].{phase}"
            try:
                cls = registry.rule(op.rule)
            except RegistryError as exc:
                raise PlanError(str(exc), source=source, layer=lp.layer, field=field + ".rule") from None
            if phase not in cls.phases:
                raise PlanError(f"rule '{op.rule}' does not run in the {phase} phase (it supports "
                                f"{sorted(cls.phases)})", source=source, layer=lp.layer, field=field + ".rule",
                                hint=f"choose a rule that supports {phase}, or 'full'")
            rule = plugin_instance(cls, op.params, source=source, layer=lp.layer, field=field + ".params",
                                   unchecked=unchecked, hint="fix the value (see `polykv plugins` and docs/rules.md)")
            check = getattr(rule, "check_capacity", None)
            if op.capacity is not None and check is not None:  # a ratio is checked when it resolves (runtime)
                try:
                    check(int(op.capacity))
                except ValueError as exc:
                    param = getattr(exc, "param", None)
                    raise PlanError(str(exc), source=source, layer=lp.layer,
                                    field=field + (f".params.{param}" if param else ".capacity")) from None
            # A rule built with its parameters may run in fewer phases than its class (a wrapper runs
            # where the rule it wraps runs): check the instance too.
            built_phases = getattr(rule, "phases", cls.phases)
            if phase not in built_phases:
                raise PlanError(f"rule '{op.rule}' with params {dict(op.params)} does not run in the {phase} "
                                f"phase (with these params it supports {sorted(built_phases)})", source=source,
                                layer=lp.layer, field=field + ".params",
                                hint=f"choose parameters (e.g. an inner rule) that run in {phase}, or another rule")
        if lp.quantized:
            _validate_quantizer(lp, registry, source, unchecked)


def _validate_quantizer(lp: LayerPlan, registry, source: str, unchecked: dict[str, set[str]]) -> None:
    """A quantized layer's quantizer is registered, stores its bit widths, takes its params and codes its ranks."""
    field = f"layers[{lp.layer}]"
    try:
        qcls = registry.quantizer(lp.quantizer)
    except RegistryError as exc:
        raise PlanError(str(exc), source=source, layer=lp.layer, field=field + ".quantizer") from None
    for name in ("k_bits", "v_bits"):
        bits = getattr(lp, name)
        if bits != PASSTHROUGH_BITS and bits not in qcls.bits:
            raise PlanError(f"quantizer '{lp.quantizer}' does not store {bits} bits (it supports "
                            f"{sorted(qcls.bits)})", source=source, layer=lp.layer,
                            field=f"{field}.{name}", hint="pick a supported width or 16")
    quantizer = plugin_instance(qcls, lp.quantizer_params, source=source, layer=lp.layer,
                                field=field + ".quantizer_params", unchecked=unchecked,
                                hint="fix the value (see `polykv plugins` and docs/quantizers.md)")
    if lp.low_rank:
        check_code_widths(lp, quantizer, source)


def validate_geometry(plan: Plan, geometry, source: str = "<plan>") -> None:
    """The plan's layers, KV heads, head dim, model fingerprint and ranks fit the model's ``geometry``."""
    if plan.num_layers != geometry.num_layers:
        raise PlanError(f"the plan has {plan.num_layers} layers but the model has {geometry.num_layers}",
                        source=source, field="layers", hint="use a plan made for this model (polykv solve)")
    m = plan.model
    if m is None:
        if plan.low_rank:
            check_ranks(plan, geometry.head_dim, source)
        return
    if m.num_kv_heads != geometry.num_kv_heads:
        raise PlanError(f"the plan was made for {m.num_kv_heads} KV heads but the model has "
                        f"{geometry.num_kv_heads}", source=source, field="model.num_kv_heads",
                        hint="use a plan made for this model")
    if m.head_dim != geometry.head_dim:
        raise PlanError(f"the plan was made for head_dim {m.head_dim} but the model has {geometry.head_dim}",
                        source=source, field="model.head_dim", hint="use a plan made for this model")
    if not fingerprints_match(m.fingerprint, geometry.fingerprint):
        raise PlanError(f"the plan was made for model {m.fingerprint} but this model is {geometry.fingerprint}",
                        source=source, field="model.fingerprint",
                        hint="solve a plan for this model, or set model.fingerprint to null to apply it anyway")
    if plan.low_rank:
        check_ranks(plan, geometry.head_dim, source)
        check_bases_file(plan, geometry, source)
