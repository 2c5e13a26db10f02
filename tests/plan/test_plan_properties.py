"""Generated plans: every valid plan round-trips through its text; every malformed one names its field."""

from __future__ import annotations

import datetime
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv.errors import PlanError
from polykv.models.geometry import ModelGeometry
from polykv.plan import (BUDGET_KINDS, FULL_OP, MAX_BUDGET_VALUE, MAX_CONTEXT_TOKENS, MAX_LOSS, LayerPlan, ModelInfo,
                         OpSpec, Plan, Provenance, TriggerSettings)
from polykv.plan.records import SCHEMA_VERSIONS
from polykv.plan.io import parse_plan_text, validate_plan
from polykv.plan.writing import dumps, plan_dict
from polykv.registry import get_registry

REGISTRY = get_registry()
OPERATORS = {e.name: e.obj for e in REGISTRY.entries("rule")}
PREFILL_RULES = sorted(n for n, cls in OPERATORS.items() if "prefill" in cls.phases and n != "full")
DECODE_RULES = sorted(n for n, cls in OPERATORS.items() if "decode" in cls.phases and n != "full")
PREFILL_ONLY = sorted(n for n, cls in OPERATORS.items() if "decode" not in cls.phases)
QUANTIZER = "kivi"
BITS = (2, 4, 8, 16)

# -- strategies -----------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False,
                                                                                   allow_infinity=False)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
params = st.dictionaries(st.text(max_size=10), json_values, max_size=3)
ratios = st.floats(min_value=0.0, max_value=1.0, exclude_min=True)


# A rule that keeps protected tokens in every head (sinks, a window) refuses a capacity they alone fill
# (kvzip-head's and kvzap's 4 default sinks): a plan valid for the registry gives such rules more.
REGISTRY_MIN_CAPACITY = 8


@st.composite
def ops(draw, names=st.text(min_size=1, max_size=12), min_capacity: int = 1):
    if draw(st.booleans()):
        return FULL_OP
    rule = draw(names.filter(lambda n: n != "full"))
    if draw(st.booleans()):
        return OpSpec(rule=rule, capacity=draw(st.integers(min_value=min_capacity, max_value=1 << 20)),
                      params=draw(params))
    return OpSpec(rule=rule, capacity_ratio=draw(ratios), params=draw(params))


@st.composite
def plans(draw, *, any_names: bool = True, with_model: bool | None = None):
    """Plans valid for the file format; with ``any_names=False`` also valid for the registry."""
    n = draw(st.integers(min_value=1, max_value=6))
    if any_names:
        pre, dec, qnames, qparams = ops(), ops(), st.text(min_size=1, max_size=8), params
    else:
        pre = ops(st.sampled_from(PREFILL_RULES), REGISTRY_MIN_CAPACITY).map(lambda o: attrs_params(o, {}))
        dec = ops(st.sampled_from(DECODE_RULES), REGISTRY_MIN_CAPACITY).map(lambda o: attrs_params(o, {}))
        qnames, qparams = st.just(QUANTIZER), st.just({})
    layers = [LayerPlan(layer=i, prefill=draw(pre), decode=draw(dec), k_bits=draw(st.sampled_from(BITS)),
                        v_bits=draw(st.sampled_from(BITS)), quantizer=draw(qnames), quantizer_params=draw(qparams))
              for i in range(n)]
    has_model = draw(st.booleans()) if with_model is None else with_model
    model = ModelInfo(num_layers=n, num_kv_heads=draw(st.integers(1, 64)), head_dim=draw(st.integers(1, 512)),
                      name=draw(st.text(max_size=12)), fingerprint=draw(st.none() | st.text(max_size=20))) \
        if has_model else None
    opt = st.none
    # provenance values in their documented ranges (a budget of one kind, an ISO time, losses >= 0, ...)
    budgets = st.builds(lambda kind, value: {kind: value}, st.sampled_from(BUDGET_KINDS),
                        st.integers(1, int(MAX_BUDGET_VALUE)) | st.floats(1.0, MAX_BUDGET_VALUE))
    times = st.datetimes(timezones=st.just(datetime.timezone.utc)).map(lambda t: t.isoformat())
    prov = Provenance(solver=draw(opt() | st.text(max_size=10)), params=draw(params),
                      budget=draw(opt() | budgets),
                      context_tokens=draw(opt() | st.integers(min_value=1, max_value=MAX_CONTEXT_TOKENS)),
                      predicted_loss=draw(opt() | st.floats(min_value=0.0, max_value=MAX_LOSS)),
                      predicted_bytes=draw(opt() | st.integers(min_value=0, max_value=int(MAX_BUDGET_VALUE))),
                      profile_fingerprint=draw(opt() | st.text(max_size=12)),
                      polykv_version=draw(opt() | st.text(max_size=6)), created=draw(opt() | times),
                      note=draw(st.text(max_size=30)))
    trigger = TriggerSettings(decode_slack=draw(st.integers(min_value=1, max_value=4096)))
    return Plan(layers=layers, model=model, trigger=trigger, provenance=prov)


def attrs_params(op: OpSpec, new_params: dict) -> OpSpec:
    import attrs

    return op if op.keeps_everything else attrs.evolve(op, params=new_params)


def matching_geometry(plan: Plan) -> ModelGeometry:
    m = plan.model
    return ModelGeometry(model_type="llama", num_layers=plan.num_layers, num_heads=m.num_kv_heads,
                         num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=None, fingerprint=m.fingerprint)


# -- valid plans ----------------------------------------------------------------------------------

@pytest.mark.slow  # 250 generated plans: several seconds
@settings(max_examples=250)
@given(plans())
def test_generated_plans_round_trip_byte_identically(plan):
    text = dumps(plan)
    again = parse_plan_text(text, "generated.json")
    assert again == plan
    assert dumps(again) == text


@settings(max_examples=60)
@given(plans(any_names=False, with_model=True))
def test_generated_registry_plans_validate(plan):
    validate_plan(plan, registry=REGISTRY, geometry=matching_geometry(plan), source="generated.json")


# -- malformed plans ------------------------------------------------------------------------------
# Each mutation takes (data, plan dict, plan) and returns (text, geometry or None, expected field).

def _layer(data, d):
    return data.draw(st.integers(0, len(d["layers"]) - 1), label="layer")


def _non_full_op(data, d):
    i = _layer(data, d)
    phase = data.draw(st.sampled_from(["prefill", "decode"]), label="phase")
    op = d["layers"][i][phase]
    if op["rule"] == "full":
        rule = PREFILL_RULES[0] if phase == "prefill" else DECODE_RULES[0]
        op.clear()
        op.update(rule=rule, capacity=8)
    return i, phase, op


def m_json_syntax(data, d, plan):
    text = dumps(plan)
    return text[:data.draw(st.integers(1, len(text) - 3), label="cut")], None, None


def m_schema_version(data, d, plan):
    d["schema_version"] = data.draw(st.one_of(st.integers().filter(lambda v: v not in SCHEMA_VERSIONS), st.just(1.0),
                                              st.just(True), st.text(), st.none()), label="version")
    return d, None, "schema_version"


def m_unknown_rule(data, d, plan):
    i, phase, op = _non_full_op(data, d)
    op["rule"] = data.draw(st.text(min_size=1, max_size=12).filter(lambda n: n not in OPERATORS), label="rule")
    return d, None, f"layers[{i}].{phase}.rule"


def m_unknown_quantizer(data, d, plan):
    i = _layer(data, d)
    d["layers"][i].update(k_bits=4, quantizer=data.draw(
        st.text(max_size=10).filter(lambda n: not REGISTRY.has("quantizer", n)), label="quantizer"))
    return d, None, f"layers[{i}].quantizer"


def m_layer_count(data, d, plan):
    n = plan.num_layers
    geo = matching_geometry(plan)
    import attrs

    other = data.draw(st.integers(1, 40).filter(lambda v: v != n), label="model layers")
    return d, attrs.evolve(geo, num_layers=other), "layers"


def m_model_num_layers(data, d, plan):
    d["model"]["num_layers"] = data.draw(st.integers(1, 40).filter(lambda v: v != plan.num_layers))
    return d, None, "model.num_layers"


def m_kv_heads(data, d, plan):
    import attrs

    geo = matching_geometry(plan)
    other = data.draw(st.integers(1, 64).filter(lambda v: v != geo.num_kv_heads), label="kv heads")
    return d, attrs.evolve(geo, num_kv_heads=other, num_heads=other), "model.num_kv_heads"


def m_bits(data, d, plan):
    i = _layer(data, d)
    name = data.draw(st.sampled_from(["k_bits", "v_bits"]))
    d["layers"][i][name] = data.draw(st.integers(-64, 64).filter(lambda b: b not in BITS)
                                     | st.sampled_from([True, 8.0, "8", None, [8]]), label="bits")
    return d, None, f"layers[{i}].{name}"


def m_capacity(data, d, plan):
    i, phase, op = _non_full_op(data, d)
    op.pop("capacity_ratio", None)
    op["capacity"] = data.draw(st.integers(max_value=0), label="capacity")
    return d, None, f"layers[{i}].{phase}.capacity"


def m_ratio(data, d, plan):
    i, phase, op = _non_full_op(data, d)
    op.pop("capacity", None)
    op["capacity_ratio"] = data.draw(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
                                     | st.floats(min_value=1.0, exclude_min=True, allow_nan=False,
                                                 allow_infinity=False) | st.just("0.5"), label="ratio")
    return d, None, f"layers[{i}].{phase}.capacity_ratio"


def m_capacity_both_or_neither(data, d, plan):
    i, phase, op = _non_full_op(data, d)
    op.pop("capacity", None)
    op.pop("capacity_ratio", None)
    if data.draw(st.booleans(), label="both"):
        op.update(capacity=4, capacity_ratio=0.5)
    return d, None, f"layers[{i}].{phase}.capacity"


def m_full_with_capacity(data, d, plan):
    i = _layer(data, d)
    phase = data.draw(st.sampled_from(["prefill", "decode"]))
    d["layers"][i][phase] = {"rule": "full", "capacity": data.draw(st.integers(1, 100))}
    return d, None, f"layers[{i}].{phase}.capacity"


def m_unknown_key(data, d, plan):
    i = _layer(data, d)
    phase = data.draw(st.sampled_from(["prefill", "decode"]))
    where = data.draw(st.sampled_from(["", "model", "trigger", "provenance", f"layers[{i}]",
                                       f"layers[{i}].{phase}"]), label="where")
    target = {"": d, "model": d["model"], "trigger": d["trigger"], "provenance": d["provenance"],
              f"layers[{i}]": d["layers"][i], f"layers[{i}].{phase}": d["layers"][i][phase]}[where]
    key = data.draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in target and k != "schema_version"),
                    label="key")
    target[key] = data.draw(json_values)
    return d, None, f"{where}.{key}" if where else key


def m_layer_index(data, d, plan):
    i = _layer(data, d)
    d["layers"][i]["layer"] = data.draw(st.integers(-3, 50).filter(lambda v: v != i))
    return d, None, f"layers[{i}].layer"


def m_wrong_phase(data, d, plan):
    i = _layer(data, d)
    d["layers"][i]["decode"] = {"rule": data.draw(st.sampled_from(PREFILL_ONLY)), "capacity": 16}
    return d, None, f"layers[{i}].decode.rule"


def m_unknown_param(data, d, plan):
    i = _layer(data, d)
    phase = data.draw(st.sampled_from(["prefill", "decode"]))
    op = d["layers"][i][phase]
    known = OPERATORS[op["rule"]].defaults
    op.setdefault("params", {})[data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in known))] = 1
    return d, None, f"layers[{i}].{phase}.params"


def m_provenance_numbers(data, d, plan):
    name, bad = data.draw(st.sampled_from([("context_tokens", st.integers(max_value=0)),
                                           ("context_tokens", st.integers(min_value=MAX_CONTEXT_TOKENS + 1)),
                                           ("predicted_bytes", st.integers(max_value=-1)),
                                           ("predicted_loss", st.just("low")),
                                           ("predicted_loss", st.floats(max_value=-1e-9, allow_infinity=False)),
                                           ("cache_dtype", st.text(max_size=8).filter(
                                               lambda t: t not in ("bfloat16", "float16", "float32")))]))
    d["provenance"][name] = data.draw(bad)
    return d, None, f"provenance.{name}"


def m_decode_slack(data, d, plan):
    d["trigger"]["decode_slack"] = data.draw(st.integers(max_value=0) | st.just(1.5))
    return d, None, "trigger.decode_slack"


MUTATIONS = [m_json_syntax, m_schema_version, m_unknown_rule, m_unknown_quantizer, m_layer_count,
             m_model_num_layers, m_kv_heads, m_bits, m_capacity, m_ratio, m_capacity_both_or_neither,
             m_full_with_capacity, m_unknown_key, m_layer_index, m_wrong_phase, m_unknown_param,
             m_provenance_numbers, m_decode_slack]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda m: m.__name__[2:])
@settings(max_examples=15)
@given(plan=plans(any_names=False, with_model=True), data=st.data())
def test_malformed_plans_fail_naming_the_field(mutate, plan, data):
    out, geometry, field = mutate(data, json.loads(json.dumps(plan_dict(plan))), plan)
    text = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)
    with pytest.raises(PlanError) as exc:
        parsed = parse_plan_text(text, "generated.json")
        validate_plan(parsed, registry=REGISTRY, geometry=geometry or matching_geometry(plan), source="generated.json")
    err = exc.value
    assert err.source == "generated.json"
    if field is None and mutate is m_json_syntax:
        found = re.search(r"malformed JSON at line (\d+), column (\d+)", str(err))
        try:
            json.loads(text)
        except json.JSONDecodeError as expected:
            assert found and (int(found[1]), int(found[2])) == (expected.lineno, expected.colno), str(err)
        return
    assert err.field == field, str(err)
    assert f"field '{field}'" in str(err)
    if mutate is m_unknown_rule:
        assert all(name in str(err) for name in OPERATORS)
