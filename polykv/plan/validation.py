"""Plan validation against the plugins and the model: every rule, allocator and quantizer a plan names exists and
takes its parameters, code widths and ranks fit, per-model data files are read by some rule and belong to the
model, and the layers fit the model's geometry.

Every error is a :class:`polykv.errors.PlanError` naming the file, the layer (when there is one) and the dotted
field, and saying what to do. :func:`polykv.plan.io.load_plan` calls :func:`validate_plan` when given a registry or
a geometry.
"""

from __future__ import annotations

import os
import warnings

from polykv.contract.model_data import ModelDataNote, needs_of_rules, side_file_problem
from polykv.contract.params import UncheckedParamsWarning, unchecked_params
from polykv.errors import PlanError, PolykvError, ProfileError, RegistryError
from polykv.models.geometry import fingerprints_match
from polykv.models.kv_bases import KV_BASES_KEY, KVBases
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.plan.groups import check_groups
from polykv.plan.records import FULL_RULE, PASSTHROUGH_BITS, PHASES, LayerPlan, OpSpec, Plan
from polykv.plan.sharing import check_shares
from polykv.plan.writing import RANK_FIELDS


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
            _validate_model_data(plan, registry, source)
    if geometry is not None:
        validate_geometry(plan, geometry, source)
    elif plan.model is not None and plan.low_rank:
        _check_ranks(plan, plan.model.head_dim, source)
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


def _validate_model_data(plan: Plan, registry, source: str) -> None:
    """Every ``model_data`` key is data some rule of the plan reads (a misspelt key would go unused)."""
    read = sorted(n.key for n in needs_of_rules(registry, sorted(plan.rules_used())))
    if plan.low_rank:
        read = sorted(read + [KV_BASES_KEY])
    for key in sorted(plan.model_data):
        if key not in read:
            raise PlanError(f"no rule of this plan reads per-model data '{key}' (they read {read or 'none'})",
                            source=source, field=f"model_data.{key}",
                            hint="remove the entry or correct its key")


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
    _check_code_widths(lp, quantizer, source)


def _check_code_widths(lp: LayerPlan, quantizer, source: str) -> None:
    """The layer's quantizer can code its ranks' widths (:meth:`~polykv.contract.stores.Quantizer.check_width`)."""
    for stream, name, bits in (("key", "k_rank", lp.k_bits), ("value", "v_rank", lp.v_bits)):
        rank = getattr(lp, name)
        if rank is None or bits == PASSTHROUGH_BITS:
            continue
        try:
            quantizer.check_width(stream, bits, rank)
        except ValueError as exc:
            raise PlanError(f"{name} {rank}: {exc}", source=source, layer=lp.layer, field=f"layers[{lp.layer}].{name}",
                            hint="choose a rank the quantizer accepts (see docs/low-rank.md), or other "
                                 "quantizer_params") from None


def _check_ranks(plan: Plan, head_dim: int, source: str) -> None:
    """Every rank fits the model's head dim."""
    for lp in plan.layers:
        for name in RANK_FIELDS:
            rank = getattr(lp, name)
            if rank is not None and rank > head_dim:
                raise PlanError(f"rank {rank} exceeds the model's head dim {head_dim}", source=source, layer=lp.layer,
                                field=f"layers[{lp.layer}].{name}",
                                hint=f"use a rank in 1..{head_dim}, or remove it for full rank")


def validate_geometry(plan: Plan, geometry, source: str = "<plan>") -> None:
    if plan.num_layers != geometry.num_layers:
        raise PlanError(f"the plan has {plan.num_layers} layers but the model has {geometry.num_layers}",
                        source=source, field="layers", hint="use a plan made for this model (polykv solve)")
    m = plan.model
    if m is None:
        if plan.low_rank:
            _check_ranks(plan, geometry.head_dim, source)
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
        _check_ranks(plan, geometry.head_dim, source)
        _check_bases_file(plan, geometry, source)


def _check_bases_file(plan: Plan, geometry, source: str) -> None:
    """The key/value bases file a plan with ranks names (when it exists) was measured on this model."""
    path = plan.model_data.get(KV_BASES_KEY)
    if not plan.low_rank or not path or not os.path.isfile(path):
        return
    try:
        KVBases.load(path).check_geometry(geometry)
    except ProfileError as exc:
        raise PlanError(str(exc), source=source, field=f"model_data.{KV_BASES_KEY}") from None


def check_side_files(plan: Plan, registry, source: str) -> None:
    """Open and check every side file ``plan.model_data`` names (what ``plan validate`` and ``study --check`` run):
    a regular file (checked with ``stat`` before it is opened), readable as the data its key names (each loader
    checks dtypes, finite and non-negative values, orthonormal bases), of the plan's layers (and KV heads and head
    dim when the plan names its model). A file outside the plan's folder, or one without a model fingerprint, gets
    a one-line note."""
    needs = {n.key: n for n in needs_of_rules(registry, sorted(plan.rules_used()))}
    if plan.low_rank:
        needs[KV_BASES_NEED.key] = KV_BASES_NEED
    folder = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
    for key, path in sorted(plan.model_data.items()):
        field = f"model_data.{key}"
        need = needs.get(key)
        if need is None:
            continue  # refused by _validate_model_data
        if not os.path.isfile(path):
            raise PlanError(f"{path} {side_file_problem(path)}", source=source, field=field,
                            hint=f"name a {need.description or key} file (paths are relative to the plan file)")
        if os.stat(path).st_size == 0:   # also what /proc and /sys files report: never opened
            raise PlanError(f"{path} is empty, not a {need.description or key} file", source=source, field=field,
                            hint=f"name a {need.description or key} file (paths are relative to the plan file)")
        try:
            data = need.load(path)
        except (PolykvError, ValueError, OSError) as exc:
            raise PlanError(f"{path} is not a usable {need.description or key} file: {exc}", source=source,
                            field=field) from None
        _check_side_shape(plan, data, path, field, source)
        # noted once the file passed its checks (a refused file gets its one error line only)
        if folder is not None and os.path.commonpath([folder, os.path.abspath(path)]) != folder:
            warnings.warn(f"{source}: field {field}: {path} is outside the plan's folder {folder}", ModelDataNote,
                          stacklevel=2)
        if not getattr(data, "fingerprint", None):
            warnings.warn(f"{source}: field {field}: {path} carries no model fingerprint, so it cannot be matched to "
                          "a model", ModelDataNote, stacklevel=2)


def _check_side_shape(plan: Plan, data, path: str, field: str, source: str) -> None:
    """The side file's layers (and KV heads, head dim when the plan names its model) are the plan's."""
    want = {"num_layers": plan.num_layers}
    if plan.model is not None:
        want.update(num_kv_heads=plan.model.num_kv_heads, head_dim=plan.model.head_dim)
    for name, expected in want.items():
        got = getattr(data, name, None)
        if isinstance(got, int) and got != expected:
            raise PlanError(f"{path} holds data for {name} {got} but the plan has {expected}", source=source,
                            field=field, hint="use the side file measured on the plan's model")
