"""Solvers keep the quantizer a profile was calibrated with: the plan stores its widths with it, budgets
them with its byte model, and the runtime then holds exactly the bytes the plan predicts."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

import polykv
from polykv.errors import SolverError
from polykv.plan import LayerPlan
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import CalibrationSettings
from polykv.profiling.profile import CandidateConfig, Profile, load_profile, loads, moend_configs
from polykv.solvers import solve
from polykv.solvers.base import Solver
from polykv.testing import tiny_model
from tests.solvers.fp8_plugin import Fp8Quantizer, registry_with_third_party

FP8 = Fp8Quantizer.name
T = 96


@pytest.fixture(scope="module")
def registry():
    return registry_with_third_party()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def fp8_profile(model, registry, tmp_path_factory):
    """A profile calibrated with the fp8 quantizer, saved and read back."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 128, (T + 32,), generator=g) for _ in range(2)]
    settings = CalibrationSettings(rules=("streamingllm", "tova"), keeps=(0.25, 0.5, 1.0), bits=(16, 8), prefix=T,
                                   stat_capacity=16, quantizer=FP8, quantizer_params={"max_code": 240.0})
    result = calibrate(model, seqs, settings, registry=registry)
    path = tmp_path_factory.mktemp("fp8") / "tiny.profile.json"
    result.profile.save(str(path))
    return load_profile(str(path))


def _table_profile(**quantizer) -> Profile:
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in moend_configs("streamingllm", "prefill", keeps=(0.25, 0.5, 1.0), k_bits=(16, 8),
                                      v_bits=(16, 8))]
    table = np.array([[(1 - c.keep) + (16 - c.k_bits) / 40 + (16 - c.v_bits) / 60 for c in configs]] * 2)
    return attrs.evolve(Profile.from_table(table, configs, (2, 2, 32)), **quantizer)


def test_profiles_record_their_quantizer_and_old_profiles_mean_kivi():
    plain = _table_profile()
    text = plain.to_json()
    assert '"quantizer"' not in text                          # KIVI with its defaults: written as before
    assert (loads(text).quantizer, loads(text).quantizer_params) == ("kivi", {})
    fp8 = _table_profile(quantizer=FP8, quantizer_params={"max_code": 240.0})
    back = loads(fp8.to_json())
    assert json.loads(fp8.to_json())["quantizer"] == {"name": FP8, "params": {"max_code": 240.0}}
    assert (back.quantizer, back.quantizer_params) == (FP8, {"max_code": 240.0})
    assert back.fingerprint == fp8.fingerprint != plain.fingerprint


def test_calibration_records_the_quantizer(fp8_profile):
    assert (fp8_profile.quantizer, fp8_profile.quantizer_params) == (FP8, {"max_code": 240.0})


@pytest.mark.parametrize("solver,params", [("exact", {}), ("moend-greedy", {"rule": "tova"}),
                                           ("uniform", {"k_bits": 8, "v_bits": 8}), ("quant-only", {"rule": "tova"})])
def test_every_solver_keeps_the_profiles_quantizer(fp8_profile, registry, solver, params):
    budget = Budget.parse("3x", T, basis="resident", cache_dtype="float32")
    plan = solve(fp8_profile, budget, solver, registry=registry, **params)
    quantized = [lp for lp in plan.layers if lp.quantized]
    assert quantized, "the budget should need 8-bit layers"
    assert all((lp.quantizer, dict(lp.quantizer_params)) == (FP8, {"max_code": 240.0}) for lp in plan.layers)
    held = sum(budget.layer_bits(fp8_profile.model, lp, registry) for lp in plan.layers) // 8
    assert plan.provenance.predicted_bytes == held
    as_kivi = [attrs.evolve(lp, quantizer="kivi", quantizer_params={}) for lp in plan.layers]
    assert sum(budget.layer_bits(fp8_profile.model, lp, registry) for lp in as_kivi) // 8 != held


def test_the_solved_plan_holds_its_predicted_bytes(fp8_profile, registry, model, tmp_path):
    budget = Budget.parse("3x", T, basis="resident", cache_dtype="float32")
    solved = solve(fp8_profile, budget, "exact", registry=registry)
    path = tmp_path / "fp8.plan.json"
    solved.save(str(path))
    plan = polykv.load_plan(str(path), registry=registry)
    assert any(lp.quantized and lp.quantizer == FP8 for lp in plan.layers)
    ids = torch.randint(1, 128, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
        session.prefill(ids)
        measured = session.resident_bytes()
    assert measured.total + measured.metadata_total == plan.provenance.predicted_bytes


def test_solve_refuses_a_quantizer_other_than_the_profiles(fp8_profile, registry):
    budget = Budget.parse("3x", T, basis="resident", cache_dtype="float32")
    with pytest.raises(SolverError, match=f"calibrated with quantizer '{FP8}'.*not 'kivi'"):
        solve(fp8_profile, budget, "exact", registry=registry, quantizer="kivi")
    with pytest.raises(SolverError, match="not 'test-fp8' {'max_code': 100.0}"):
        solve(fp8_profile, budget, "exact", registry=registry, quantizer=FP8, quantizer_params={"max_code": 100.0})
    plan = solve(fp8_profile, budget, "exact", registry=registry, quantizer=FP8)   # the profile's: accepted
    assert any(lp.quantized for lp in plan.layers)


class KiviWriter(Solver):
    """A solver that writes its layers without the profile's quantizer (the plan default, KIVI)."""

    name = "test-kivi-writer"

    def solve(self, profile, budget, **params):
        layers = [LayerPlan(layer=i, k_bits=8, v_bits=8) for i in range(profile.num_layers)]
        return self.plan(profile, budget, layers, {}, predicted_loss=None, predicted_bits=0)


def test_a_solver_layer_with_another_quantizer_is_refused(fp8_profile, registry):
    budget = Budget.parse("1x", T, basis="resident", cache_dtype="float32")
    with pytest.raises(SolverError, match=f"layer 0 stores K8/V8 with quantizer 'kivi' but .* calibrated with "
                                          f"'{FP8}'"):
        KiviWriter(registry=registry).solve(fp8_profile, budget)
