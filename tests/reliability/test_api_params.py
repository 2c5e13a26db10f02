"""Parameters through the Python API: every plugin kind declares ParamSpecs (with their defaults), plan
validation (load_plan with a registry, polykv.apply) checks rules, quantizers and allocators alike,
naming the plugin, layer and field in one line, and warns once about parameters without a spec."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import polykv
from polykv.contract.allocators import Allocator
from polykv.errors import PlanError
from polykv.memory import memory_report, predict_resident
from polykv.contract.params import ParamError, ParamSpec, UncheckedParamsWarning, with_defaults
from polykv.plan import validate_plan
from polykv.plan.io import parse_plan_text
from polykv.registry import get_registry
from polykv.testing import tiny_model
from tests.solvers.fp8_plugin import PLUGIN_NAME, ThirdParty, registry_with_third_party

PLAN = {
    "schema_version": 1,
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "name": "tiny", "fingerprint": None},
    "layers": [
        {"layer": 0, "prefill": {"rule": "streamingllm", "capacity": 16}, "decode": {"rule": "full"},
         "k_bits": 8, "v_bits": 8, "quantizer": "test-fp8"},
        {"layer": 1, "prefill": {"rule": "streamingllm", "capacity": 16}, "decode": {"rule": "full"},
         "k_bits": 16, "v_bits": 16},
    ],
}


@pytest.fixture(scope="module")
def registry():
    return registry_with_third_party()


def _plan(**changes):
    raw = copy.deepcopy(PLAN)
    for path, value in changes.items():
        node, keys = raw, path.split(".")
        for k in keys[:-1]:
            node = node[int(k) if k.isdigit() else k]
        node[keys[-1]] = value
    return parse_plan_text(json.dumps(raw), "p.json")


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_wrong_typed_quantizer_param_names_the_quantizer_layer_and_field(registry):
    plan = _plan(**{"layers.0.quantizer_params": {"max_code": "448"}})
    with pytest.raises(PlanError) as exc:
        validate_plan(plan, registry=registry, source="p.json")
    text = _one_line(exc)
    assert "p.json, layer 0, field 'layers[0].quantizer_params.max_code'" in text
    assert "quantizer 'test-fp8': parameter 'max_code' must be a number in [1, 448], got '448'" in text


def test_a_wrong_typed_allocator_param_names_the_allocator_layer_and_field(registry):
    plan = _plan(allocation=[{"allocator": "test-min-tokens", "layers": [0, 1], "params": {"min_tokens": "64"}}])
    with pytest.raises(PlanError) as exc:
        validate_plan(plan, registry=registry, source="p.json")
    text = _one_line(exc)
    assert "p.json, layer 0, field 'allocation[0].params.min_tokens'" in text
    assert "allocator 'test-min-tokens': parameter 'min_tokens' must be an integer" in text
    assert "the group holds layers [0, 1]" in text


def test_builtin_allocator_and_quantizer_params_are_checked_by_type(registry):
    plan = _plan(allocation=[{"allocator": "cake", "layers": [0, 1], "params": {"window": "32"}}])
    with pytest.raises(PlanError, match=r"allocation\[0\].params.window'.*allocator 'cake': parameter 'window'"):
        validate_plan(plan, registry=registry)
    plan = _plan(**{"layers.0.quantizer": "kivi", "layers.0.quantizer_params": {"group_size": 16.0}})
    with pytest.raises(PlanError, match=r"layers\[0\].quantizer_params.group_size'.*quantizer 'kivi'"):
        validate_plan(plan, registry=registry)


def test_apply_refuses_a_wrong_typed_quantizer_param_before_any_forward(registry):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)
    plan = _plan(**{"layers.0.quantizer_params": {"max_code": None}})
    with pytest.raises(PlanError, match=r"layer 0, field 'layers\[0\].quantizer_params.max_code'"):
        polykv.apply(model, plan, registry=registry)


def test_a_rule_without_specs_gets_one_warning_at_validation(registry):
    plan = _plan(**{"layers.0.prefill": {"rule": "test-unspecced", "capacity": 16, "params": {"min_similarity": "high"}},
                    "layers.1.prefill": {"rule": "test-unspecced", "capacity": 16, "params": {"min_similarity": 0.2}}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_plan(plan, registry=registry, source="p.json")
    got = [w for w in caught if issubclass(w.category, UncheckedParamsWarning)]
    assert len(got) == 1, [str(w.message) for w in caught]
    assert str(got[0].message).startswith("p.json: rule 'test-unspecced' declares no param_specs for "
                                          "['min_similarity']")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_plan(_plan(), registry=registry)        # plugins that declare their specs: no warning


def test_plan_validate_prints_the_warning_in_one_line(tmp_path, capsys):
    from polykv.cli import main

    raw = copy.deepcopy(PLAN)
    raw["layers"][0] = {"layer": 0, "prefill": {"rule": "test-unspecced", "capacity": 16,
                                                "params": {"min_similarity": "high"}},
                        "decode": {"rule": "full"}, "k_bits": 16, "v_bits": 16}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    registry = get_registry()
    registry.register_plugin(ThirdParty(), name=PLUGIN_NAME)
    try:
        assert main(["plan", "validate", str(path)]) == 0
    finally:
        registry.unregister_plugin(PLUGIN_NAME)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("polykv plan validate: warning: ")
    assert "rule 'test-unspecced' declares no param_specs for ['min_similarity']" in err[0]


def test_a_spec_carries_the_default_and_defaults_derive_from_it():
    class Alloc(Allocator):
        name = "spec-only"
        param_specs = {"floor": ParamSpec(int, default=3, low=0)}

    assert dict(Alloc.defaults) == {"floor": 3} and Alloc().params == {"floor": 3}
    with pytest.raises(ParamError, match="allocator 'spec-only': parameter 'floor' must be an integer >= 0"):
        Alloc(floor="3")

    class OldStyle(Allocator):             # a third-party plugin of before: defaults, specs without them
        name = "old-style"
        defaults = {"floor": 5, "free": "x"}
        param_specs = {"floor": ParamSpec(int, low=0)}

    assert OldStyle.param_specs["floor"].default == 5 and OldStyle().params == {"floor": 5, "free": "x"}

    class Narrower(Alloc):
        name = "narrower"
        param_specs = with_defaults(Alloc.param_specs, floor=1)

    assert Narrower().params == {"floor": 1} and Alloc().params == {"floor": 3}
    with pytest.raises(TypeError, match=r"parameter\(s\) \['floor'\] declare no default"):
        class NoDefault(Allocator):
            name = "no-default"
            param_specs = {"floor": ParamSpec(int)}


def test_every_builtin_parameter_has_a_spec_its_default_satisfies():
    registry = get_registry()
    for kind in ("rule", "quantizer", "allocator"):
        for entry in registry.entries(kind):
            if not entry.plugin.startswith("polykv."):
                continue
            cls = entry.obj
            assert set(cls.param_specs) == set(cls.defaults), (kind, entry.name)
            for name, spec in cls.param_specs.items():
                assert spec.default == cls.defaults[name]
                spec.check(name, spec.default)


def test_memory_report_takes_the_allocations_predict_resident_takes():
    plan = parse_plan_text(json.dumps({**PLAN, "layers": [dict(PLAN["layers"][1], layer=i) for i in range(2)],
                                       "allocation": [{"allocator": "d2o", "layers": [0, 1]}]}), "p.json")
    geo = plan.model
    allocations = {0: {"budget": 10}, 1: {"budget": 22}}
    rows = predict_resident(plan, geo, 64, dtype_bytes=4, allocations=allocations)
    report = memory_report(plan, geo, 64, dtype_bytes=4, allocations=allocations)
    assert [r.resident_bytes for r in report.rows] == [r.resident_bytes for r in rows]
    assert not any(r.bound for r in report.rows)
    assert report.rows[0].kept_tokens == 10 and report.rows[1].kept_tokens == 22
    assert any(r.bound for r in memory_report(plan, geo, 64, dtype_bytes=4).rows)
