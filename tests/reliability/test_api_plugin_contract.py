"""The plugin contract at the Python API: a rule class that breaks it is refused when it is defined (one line
naming the class and what to write), and a built rule refuses bad parameters as plan validation reports them."""

from __future__ import annotations

import pytest

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.adapters.rules.pyramidkv import PyramidKVAllocator, PyramidKVRule
from polykv.adapters.rules.snapkv import SnapKVRule
from polykv.contract import ParamError, ScoredRule, param


def _define(body: dict, base: type = ScoredRule, annotations: dict | None = None) -> type:
    namespace = {"name": "api-contract-rule", "score": lambda self, ctx: ctx.positions.float(), **body}
    if annotations is not None:
        namespace["__annotations__"] = annotations
    return type("Checked", (base,), namespace)


@pytest.mark.parametrize("body, annotations, expect", [
    ({"signal": "observation-window"}, None, r"rule Checked: signal 'observation-window' is not one of \['none'"),
    ({"phases": frozenset({"prefil"})}, None, r"rule Checked: phases must be a non-empty frozenset of"),
    ({"phases": "prefill"}, None, r"phases must be a non-empty frozenset"),
    ({"window": param(0, low=1)}, {"window": "int"}, r"the default of parameter 'window' must be >= 1, got 0"),
    ({"window": param(2.5)}, {"window": "int"}, r"the default of parameter 'window' must be an integer, got 2.5"),
    ({"ids": param([-1], low=0)}, {"ids": "list[int]"}, r"the default of parameter 'ids' must be a list of integers"),
    ({"window": param(3)}, {}, r"field 'window' must be a typed param\(\.\.\.\)"),
    ({"window": param(3)}, {"window": "tuple"}, r"parameter 'window' is annotated 'tuple'"),
    ({"window": param(3)}, {"window": "int | str"}, r"parameter 'window' is annotated 'int \| str'"),
    ({"window": param(3), "defaults": {"window": 3}}, {"window": "int"}, r"either as fields .* not both"),
])
def test_a_rule_class_breaking_the_contract_is_refused_when_defined(body, annotations, expect):
    with pytest.raises(TypeError, match=expect):
        _define(body, annotations=annotations)


@pytest.mark.parametrize("assign, expect", [
    ({"window": 0}, r"rule Narrow: the default of parameter 'window' must be >= 1, got 0"),
    ({"kernel_size": 4}, r"the default of parameter 'kernel_size' must be an odd integer in \[1, 4096\], got 4"),
    ({"pooling": "mean"}, r"the default of parameter 'pooling' must be one of 'max', 'avg', got 'mean'"),
])
def test_a_subclass_default_outside_the_declaration_is_refused(assign, expect):
    with pytest.raises(TypeError, match=expect):
        type("Narrow", (SnapKVRule,), {"name": "api-narrow", **assign})


@pytest.mark.parametrize("cls, params, param_name, expect", [
    (SnapKVRule, {"window": -3}, "window", r"rule 'snapkv': parameter 'window' must be >= 1, got -3"),
    (SnapKVRule, {"window": "32"}, "window", r"parameter 'window' must be an integer in \[1, 1048576\], got '32'"),
    (SnapKVRule, {"kernel_size": 6}, "kernel_size", r"must be an odd integer in \[1, 4096\], got 6"),
    (PyramidKVRule, {"pooling": "mean"}, "pooling", r"rule 'pyramidkv': parameter 'pooling' must be one of"),
    (PyramidKVAllocator, {"beta": 0}, "beta", r"allocator 'pyramidkv': parameter 'beta' must be >= 1, got 0"),
    (KiviQuantizer, {"group_size": True}, "group_size", r"quantizer 'kivi': parameter 'group_size' must be an "
                                                        r"integer in \[1, 65536\], got True"),
    (KiviQuantizer, {"residual": 48}, "residual", r"residual=48 must be a multiple of group_size=32"),
])
def test_a_typed_field_refuses_a_bad_value_naming_the_parameter(cls, params, param_name, expect):
    with pytest.raises(ParamError, match=expect) as exc:
        cls(**params)
    assert exc.value.param == param_name


def test_an_unknown_parameter_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"rule 'snapkv' has no parameter\(s\) \['windw'\]; known: \['kernel_size', "
                                         r"'pooling', 'window'\]"):
        SnapKVRule(windw=8)


def test_fields_are_attributes_and_params_is_a_read_only_mapping():
    rule = PyramidKVRule(window=16)
    assert (rule.window, rule.kernel_size, rule.pooling) == (16, 7, "max")     # PyramidKV's own defaults
    assert dict(rule.params) == {"window": 16, "kernel_size": 7, "pooling": "max"}
    assert PyramidKVRule.defaults == {"window": 8, "kernel_size": 7, "pooling": "max"}
    assert SnapKVRule.defaults["window"] == 32                                  # the parent keeps its own
    with pytest.raises(TypeError):
        rule.params["window"] = 4


def test_a_0_1_rule_declaring_param_specs_still_works():
    from polykv.contract.params import ParamSpec

    old = type("Old", (ScoredRule,), {"name": "api-old", "param_specs": {"sinks": ParamSpec(int, default=4, low=0)},
                                      "score": lambda self, ctx: ctx.positions.float()})
    assert old().params["sinks"] == 4 and old(sinks=2).params == {"sinks": 2}
    with pytest.raises(ParamError, match=r"rule 'api-old': parameter 'sinks' must be >= 0, got -1"):
        old(sinks=-1)
