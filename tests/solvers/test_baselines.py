"""uniform (best / 1d / 2d_uniform), quant-only, pyramid, and which phase gets the rule."""

from __future__ import annotations

import numpy as np
import pytest

from polykv import get_registry
from polykv.errors import SolverError
from polykv.memory import nominal_bytes
from polykv.plan import validate_plan
from polykv.profiling.budget import Budget, full_cache_bytes
from polykv.profiling.profile import CandidateConfig, Profile
from polykv.solvers import solve
from polykv.contract.schedules import pyramid_capacities, trim_to


@pytest.fixture(scope="module")
def profile(kit):
    rng = np.random.default_rng(11)
    base = kit.grid_profile(np.zeros((8, 54)))
    return kit.grid_profile(kit.monotone_table(rng, 8, base.configs) + rng.random((8, 54)) * 0.01)


def _interp(profile, rule, kb, vb, keep):
    """Summed loss of ``rule`` at (kb, vb) interpolated linearly in keep (keep-1.0 config closes the range)."""
    table = profile.table()
    pts = sorted((c.keep, table[:, i].sum()) for i, c in enumerate(profile.configs)
                 if c.k_bits == kb and c.v_bits == vb and (c.rule == rule or c.keeps_everything))
    return float(np.interp(keep, [k for k, _ in pts], [v for _, v in pts]))


def test_uniform_fills_its_budget_with_the_largest_keep_that_fits(profile, kit):
    T = 1000
    budget = Budget.of_ratio(4, T)
    cap = budget.to_bits(profile.model)
    slot = 2 * 16  # Hkv * d
    for mode, pairs in (("1d", [(16, 16)]), ("2d_uniform", None), ("best", None)):
        plan = solve(profile, budget, "uniform", mode=mode)
        lp = plan.layers[0]
        same = {(x.prefill.describe(), x.decode.describe(), x.k_bits, x.v_bits) for x in plan.layers}
        assert len(same) == 1, "uniform: the same layer everywhere"
        assert lp.prefill.capacity is None and lp.prefill.capacity_ratio is not None  # a ratio: any length
        t = lp.prefill.resolve_capacity(T)
        per_token = slot * (lp.k_bits + lp.v_bits)
        assert 8 * t * per_token <= cap < 8 * (t + 1) * per_token, (mode, t)  # the largest keep that fits
        # it is the best width pair: no other profiled pair at its own largest keep has a lower loss
        for kb, vb in (pairs or [(k, v) for k in (16, 8, 4) for v in (16, 8, 4)]):
            tt = min(cap // (8 * slot * (kb + vb)), T)
            if tt / T >= 0.1:
                assert plan.provenance.predicted_loss <= _interp(profile, "tova", kb, vb, tt / T) + 1e-9
        assert plan.provenance.predicted_loss == pytest.approx(
            _interp(profile, "tova", lp.k_bits, lp.v_bits, t / T))
        assert plan.provenance.predicted_bytes > 0.97 * budget.to_bytes(profile.model)
    one = solve(profile, Budget.of_tokens(250, T), "uniform", mode="1d")
    assert {lp.prefill.resolve_capacity(T) for lp in one.layers} == {250}
    fixed = solve(profile, budget, "uniform", mode="2d_uniform", k_bits=8, v_bits=4)
    assert {(lp.k_bits, lp.v_bits) for lp in fixed.layers} == {(8, 4)}
    assert fixed.layers[0].prefill.resolve_capacity(T) == cap // (8 * slot * 12)


def test_resident_uniform_fills_within_3_percent_below_the_budget():
    """On the resident basis (positions, scales and residuals counted) a uniform plan lands just under its budget."""
    from polykv.memory import held_bytes_per_layer

    rng = np.random.default_rng(3)
    from polykv.profiling.profile import moend_configs

    configs = moend_configs("snapkv", "prefill")
    profile = Profile.from_table(rng.random((6, len(configs))), configs, (6, 3, 64))
    for ratio in (4, 8, 12):
        for T in (1000, 2048):
            budget = Budget.of_ratio(ratio, T, basis="resident")
            for mode in ("1d", "2d_uniform", "best"):
                plan = solve(profile, budget, "uniform", mode=mode)
                held = sum(held_bytes_per_layer(plan, None, T))
                assert 0.97 * budget.to_bytes(profile.model) <= held <= budget.to_bytes(profile.model), (ratio, T, mode)
                assert plan.provenance.predicted_bytes == held and plan.provenance.basis == "resident"
            two = solve(profile, budget, "quant-only")
            assert sum(held_bytes_per_layer(two, None, T)) <= budget.to_bytes(profile.model)


def test_quant_only_fixes_one_keep_and_routes_bits(profile):
    T = 1000
    budget = Budget.of_ratio(4, T)
    plan = solve(profile, budget, "quant-only")
    keep = plan.provenance.params["keep"]
    # the largest keep whose K8/V4 uniform plan fits 1/4 of a 16-bit cache: 1000 * 32 / 4 / 12 = 666 tokens
    assert keep == pytest.approx(666 / T)
    assert {lp.prefill.resolve_capacity(T) for lp in plan.layers} == {666}
    assert plan.provenance.predicted_bytes <= budget.to_bytes(profile.model)
    exact = solve(profile, budget, "exact")
    assert exact.provenance.predicted_loss <= plan.provenance.predicted_loss + 0.05  # interpolated vs profiled
    with pytest.raises(SolverError, match="below every profiled keep"):
        solve(profile, budget, "quant-only", keep=0.05)


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
    caps = [lp.prefill.resolve_capacity(2048) for lp in plan.layers]
    assert caps == sorted(caps, reverse=True) and sum(caps) <= 8 * 128
    assert all(lp.prefill.rule == "snapkv" and lp.prefill.params == {"window": 8} for lp in plan.layers)
    assert all(lp.decode.keeps_everything for lp in plan.layers)
    validate_plan(plan, registry=get_registry())
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
    with pytest.raises(SolverError, match=r"unknown rule 'nosuchrule'. Available: .*tova"):
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
