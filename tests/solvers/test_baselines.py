"""uniform (best / 1d / 2d_uniform), quant-only, pyramid, and which phase gets the rule."""

from __future__ import annotations

import numpy as np
import pytest

from polykv import get_registry
from polykv.errors import SolverError
from polykv.memory import nominal_bytes
from polykv.profiling.budget import Budget, full_cache_bytes
from polykv.profiling.profile import CandidateConfig, Profile
from polykv.solvers import solve
from polykv.solvers.pyramid import pyramid_capacities, trim_to


@pytest.fixture(scope="module")
def profile(kit):
    rng = np.random.default_rng(11)
    base = kit.grid_profile(np.zeros((8, 54)))
    return kit.grid_profile(kit.monotone_table(rng, 8, base.configs) + rng.random((8, 54)) * 0.01)


def test_uniform_best_is_the_cheapest_summed_loss_that_fits(profile):
    budget = Budget.of_ratio(4, 1000)
    plan = solve(profile, budget, "uniform")
    table, cap = profile.table(), budget.to_bits(profile.model)
    fits = [i for i, c in enumerate(profile.configs)
            if 8 * 2 * 16 * (c.k_bits + c.v_bits) * int(np.ceil(c.keep * 1000 - 1e-9)) <= cap]
    best = min(fits, key=lambda i: table[:, i].sum())
    assert plan.provenance.predicted_loss == pytest.approx(table[:, best].sum())
    assert len({(lp.prefill.describe(), lp.k_bits, lp.v_bits) for lp in plan.layers}) == 1
    plan.validate(registry=get_registry())


def test_1d_and_2d_uniform_keep_the_token_budget(profile, kit):
    budget = Budget.of_tokens(250, 1000)
    one = solve(profile, budget, "uniform", mode="1d")
    assert all(lp.prefill.capacity == lp.decode.capacity == 250 and (lp.k_bits, lp.v_bits) == (16, 16)
               for lp in one.layers)
    assert one.provenance.predicted_bytes == budget.to_bytes(profile.model)
    assert one.provenance.predicted_loss is not None  # 250 tokens = keep 0.25, which is profiled
    two = solve(profile, budget, "uniform", mode="2d_uniform", rule="tova")
    assert all(lp.prefill.capacity == 250 and (lp.k_bits, lp.v_bits) == (8, 4) for lp in two.layers)
    assert two.provenance.predicted_bytes * 32 == one.provenance.predicted_bytes * 12
    odd = solve(profile, Budget.of_tokens(300, 1000), "uniform", mode="1d")
    assert odd.provenance.predicted_loss is None and "not profiled" in odd.provenance.note
    assert kit.plan_bits(odd, profile, 1000) == Budget.of_tokens(300, 1000).to_bits(profile.model)


def test_quant_only_fixes_one_keep_and_routes_bits(profile):
    budget = Budget.of_ratio(4, 1000)
    plan = solve(profile, budget, "quant-only")
    keep = plan.provenance.params["keep"]
    # the largest profiled keep whose K8/V4 uniform plan fits 1/4 of a 16-bit cache: 0.75 * 12/32 <= 1/4 fails,
    # 0.5 * 12 / 32 = 0.1875 fits
    assert keep == 0.5
    assert {lp.prefill.capacity_ratio for lp in plan.layers} == {0.5}
    assert plan.provenance.predicted_bytes <= budget.to_bytes(profile.model)
    exact = solve(profile, budget, "exact")
    assert exact.provenance.predicted_loss <= plan.provenance.predicted_loss
    with pytest.raises(SolverError, match="not profiled"):
        solve(profile, budget, "quant-only", keep=0.3)


def test_pyramid_schedule_matches_the_formula():
    # L=6, T=1024, M=256, w=8, beta=20: min=12, max=484, step=94
    assert pyramid_capacities(6, 1024, 256) == [492, 398, 304, 210, 116, 22]
    assert trim_to([492, 398, 304, 210, 116, 22], 6 * 256) == ([486, 398, 304, 210, 116, 22], 6)
    assert pyramid_capacities(6, 200, 256) is None            # T < M: no compression
    assert pyramid_capacities(4, 400, 256) == [256] * 4       # T < 2 (M - w): uniform
    assert pyramid_capacities(3, 184, 100) == [184, 100, 16]  # max clipped to T - w


def test_pyramid_plan_is_prefill_snapkv_within_budget(profile):
    budget = Budget.of_tokens(128, 2048)
    plan = solve(profile, budget, "pyramid")
    caps = [lp.prefill.capacity for lp in plan.layers]
    assert caps == sorted(caps, reverse=True) and sum(caps) <= 8 * 128
    assert all(lp.prefill.rule == "snapkv" and lp.prefill.params == {"window": 8} for lp in plan.layers)
    assert all(lp.decode.keeps_everything for lp in plan.layers)
    plan.validate(registry=get_registry())
    assert solve(profile, Budget.of_tokens(4096, 2048), "pyramid").keeps_everything


def _one_config_profile(rule, phase):
    configs = [CandidateConfig(rule=rule, phase=phase, keep=0.5), CandidateConfig(rule="full", keep=1.0)]
    return Profile.from_table([[0.1, 0.0]] * 2, configs, (2, 1, 8))


def test_config_phase_decides_which_op_gets_the_rule():
    budget = Budget.of_ratio(2, 100)
    pre = solve(_one_config_profile("snapkv", "prefill"), budget, "exact").layers[0]
    assert pre.prefill.rule == "snapkv" and pre.decode.keeps_everything
    dec = solve(_one_config_profile("tova", "decode"), budget, "exact").layers[0]
    assert dec.prefill.keeps_everything and dec.decode.rule == "tova"
    both = solve(_one_config_profile("tova", "both"), budget, "exact").layers[0]
    assert both.prefill.rule == both.decode.rule == "tova"


def test_a_rule_that_cannot_run_in_the_configured_phase_is_an_error():
    with pytest.raises(SolverError, match=r"rule 'snapkv' is configured for phase 'both' but does not run in "
                                          r"\['decode'\]"):
        solve(_one_config_profile("snapkv", "both"), Budget.of_ratio(2, 100), "exact")
    with pytest.raises(SolverError, match=r"unknown operator 'nosuchrule'. Available: .*tova"):
        solve(_one_config_profile("nosuchrule", "both"), Budget.of_ratio(2, 100), "exact")


def test_every_solver_stays_within_budget(profile, kit):
    T = 1000
    for frac in (0.15, 0.3, 0.6, 1.0):
        budget = Budget.of_bytes(int(frac * full_cache_bytes(profile.model, T)), T)
        for name, params in [("exact", {}), ("moend-greedy", {}), ("uniform", {}), ("uniform", {"mode": "1d"}),
                             ("uniform", {"mode": "2d_uniform"}), ("quant-only", {}), ("pyramid", {})]:
            plan = solve(profile, budget, name, **params)
            assert kit.plan_bits(plan, profile, T) <= budget.to_bits(profile.model), (name, params, frac)
            assert plan.provenance.predicted_bytes == sum(nominal_bytes(plan, None, T, phase="decode"))
            assert plan.provenance.solver == name and plan.provenance.context_tokens == T
            assert plan.provenance.profile_fingerprint == profile.fingerprint
