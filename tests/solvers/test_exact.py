"""The exact solver is optimal (brute force), never worse than the greedy, monotone in the budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv.errors import SolverError
from polykv.profiling.budget import Budget, full_cache_bytes
from polykv.solvers import solve
from polykv.solvers.mckp import Infeasible, solve_mckp

SMALL = dict(keeps=(0.25, 0.5, 1.0), k_bits=(16, 4), v_bits=(8, 4))  # 12 configs


@st.composite
def instances(draw, max_layers=4):
    L = draw(st.integers(1, max_layers))
    n = 12
    values = draw(st.lists(st.floats(0, 10, allow_nan=False, width=32), min_size=L * n, max_size=L * n))
    T = draw(st.integers(1, 64))
    frac = draw(st.floats(0.0, 1.05))
    return np.array(values).reshape(L, n), T, frac


def _budget(profile, T, frac):
    return Budget.of_bytes(max(1, int(frac * full_cache_bytes(profile.model, T))), T)


@settings(max_examples=60)
@given(instances(max_layers=3))
def test_exact_equals_brute_force(kit, inst):
    table, T, frac = inst
    profile = kit.grid_profile(table, dims=(None, 1, 4), **SMALL)
    budget = _budget(profile, T, frac)
    best = kit.brute_force(profile, budget)
    if best is None:
        with pytest.raises(SolverError, match="minimum feasible budget"):
            solve(profile, budget, "exact")
        return
    plan = solve(profile, budget, "exact")
    assert plan.provenance.predicted_loss == pytest.approx(best, abs=1e-9)
    assert kit.plan_bits(plan, profile, T) <= budget.to_bits(profile.model)
    assert 8 * plan.provenance.predicted_bytes >= kit.plan_bits(plan, profile, T)


def test_exact_equals_brute_force_on_four_layers(kit):
    rng = np.random.default_rng(7)
    for trial in range(4):
        profile = kit.grid_profile(rng.random((4, 12)).round(1), dims=(None, 1, 4), **SMALL)
        budget = _budget(profile, 32, rng.uniform(0.2, 0.9))
        best = kit.brute_force(profile, budget)
        assert solve(profile, budget, "exact").provenance.predicted_loss == pytest.approx(best, abs=1e-9)


@settings(max_examples=40)
@given(st.integers(1, 8), st.integers(0, 2**32 - 1), st.floats(0.05, 1.0), st.booleans())
def test_exact_never_worse_than_greedy(kit, L, seed, frac, monotone):
    rng = np.random.default_rng(seed)
    base = kit.grid_profile(np.zeros((L, 54)))
    table = kit.monotone_table(rng, L, base.configs) if monotone else rng.random((L, 54))
    profile = kit.grid_profile(table)
    budget = _budget(profile, 512, frac)
    try:
        greedy = solve(profile, budget, "moend-greedy")
    except SolverError:
        with pytest.raises(SolverError):
            solve(profile, budget, "exact", rules=["tova"])  # the greedy's cheapest start is every config's floor
        return
    exact = solve(profile, budget, "exact")
    assert exact.provenance.predicted_loss <= greedy.provenance.predicted_loss + 1e-12
    for plan in (greedy, exact):
        assert kit.plan_bits(plan, profile, 512) <= budget.to_bits(profile.model)


def test_loss_non_increasing_in_budget(kit):
    rng = np.random.default_rng(3)
    profile = kit.grid_profile(rng.random((12, 54)))
    full = full_cache_bytes(profile.model, 1000)
    losses = [solve(profile, Budget.of_bytes(int(full * f), 1000), "exact").provenance.predicted_loss
              for f in np.linspace(0.03, 1.0, 25)]
    assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:]))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("solver", ["exact", "moend-greedy"])
def test_full_budget_keeps_everything_at_16_bits(kit, solver):
    rng = np.random.default_rng(5)
    base = kit.grid_profile(np.zeros((6, 54)))
    profile = kit.grid_profile(kit.monotone_table(rng, 6, base.configs))
    plan = solve(profile, Budget.of_ratio(1, 777), solver)
    assert plan.keeps_everything
    assert all(lp.k_bits == 16 and lp.v_bits == 16 for lp in plan.layers)
    assert plan.provenance.predicted_loss == 0.0
    assert plan.provenance.predicted_bytes == full_cache_bytes(profile.model, 777)


def test_mckp_reports_the_lightest_weight_when_infeasible():
    with pytest.raises(Infeasible) as info:
        solve_mckp(np.zeros((3, 2)), np.array([[5, 9], [4, 1], [7, 7]]), 12)
    assert info.value.need == 13


def test_mckp_respects_allowed_mask():
    loss = np.array([[0.0, 1.0], [0.0, 1.0]])
    allowed = np.array([[False, True], [True, True]])
    choice, total, weight = solve_mckp(loss, np.array([1, 1]), 10, allowed)
    assert choice.tolist() == [1, 0] and total == 1.0 and weight == 2
