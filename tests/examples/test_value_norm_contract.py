"""The example rule passes the contract checker, as a plugin's own tests would run it, and the checker
fails a broken variant of it in one line naming the rule, the layer and the phase."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from polykv.errors import PluginContractError
from polykv.plugin_checks import check_rule

MODULE = Path(__file__).resolve().parents[2] / "examples" / "polykv-value-norm" / "polykv_value_norm" / "__init__.py"


@pytest.fixture(scope="module")
def value_norm():
    spec = importlib.util.spec_from_file_location("polykv_value_norm_checked", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ValueNormRule


@pytest.mark.parametrize("params", [{}, {"sinks": 0}, {"sinks": 2}])
def test_the_example_rule_passes_check_rule(value_norm, params):
    calls = check_rule(value_norm, params)
    assert calls["prefill"] > 0 and calls["decode"] > 0


def test_a_variant_scoring_values_summed_over_heads_fails_check_rule(value_norm):
    class SummedOverHeads(value_norm):
        name = "value-norm-summed"

        def score(self, ctx):
            return super().score(ctx).sum(dim=1)                        # [B, T]: a broadcast would hide it

    with pytest.raises(PluginContractError) as exc:
        check_rule(SummedOverHeads)
    assert str(exc.value).startswith("layer 0 (prefill): rule 'value-norm-summed' score() returned shape (2, 40); "
                                     "expected [B, Hkv, T] = (2, 2, 40)")
