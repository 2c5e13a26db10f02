"""MoE-nD's greedy: a hand-worked example, its failure message, and its grid requirements."""

from __future__ import annotations

import numpy as np
import pytest

from polykv.errors import SolverError
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.greedy import moend_greedy

AXES = dict(keeps=(0.5, 1.0), k_bits=(16, 4), v_bits=(16, 4))
# One KV head of dim 1 and T = 4: keep 0.5 stores 2 tokens, keep 1.0 stores 4; bits = tokens * (K + V).
#   (0.5,K4,V4)=16  (0.5,K4,V16)=40  (0.5,K16,V4)=40  (0.5,K16,V16)=64
#   (1.0,K4,V4)=32  (1.0,K4,V16)=80  (1.0,K16,V4)=80  (1.0,K16,V16)=128
LOSS = [
    {(0.5, 4, 4): 1.0, (1.0, 4, 4): 0.6, (0.5, 16, 4): 0.5, (0.5, 4, 16): 0.9,
     (0.5, 16, 16): 0.4, (1.0, 16, 4): 0.3, (1.0, 4, 16): 0.5, (1.0, 16, 16): 0.0},
    {(0.5, 4, 4): 1.0, (1.0, 4, 4): 1.2, (0.5, 16, 4): 0.95, (0.5, 4, 16): 0.2,
     (0.5, 16, 16): 0.1, (1.0, 16, 4): 0.9, (1.0, 4, 16): 0.15, (1.0, 16, 16): 0.0},
]


def hand_profile() -> Profile:
    configs = moend_configs("tova", **AXES)
    table = [[LOSS[layer][(c.keep, c.k_bits, c.v_bits)] for c in configs] for layer in range(2)]
    return Profile.from_table(table, configs, (2, 1, 1))


def test_greedy_matches_hand_worked_example():
    # Start: both layers at (0.5, K4, V4): 2 x 16 = 32 bits. Budget 9 bytes = 72 bits.
    # Step 1 candidates (dS/dm): L0 keep 0.4/16=.025, L0 K .5/24=.0208, L0 V .1/24=.0042,
    #   L1 keep: loss rises 1.0 -> 1.2, skipped; L1 K .05/24; L1 V .8/24=.0333 -> L1 V (used 56).
    # Step 2: only upgrades of <= 16 bits fit: L0 keep (16) -> used 72. Step 3: nothing fits.
    plan = solve(hand_profile(), Budget.of_bytes(9, 4), "moend-greedy")
    l0, l1 = plan.layers
    assert l0.keeps_everything is False and l0.prefill.keeps_everything and l0.decode.keeps_everything
    assert (l0.k_bits, l0.v_bits) == (4, 4)
    assert l1.prefill.rule == l1.decode.rule == "tova" and l1.prefill.capacity_ratio == 0.5
    assert (l1.k_bits, l1.v_bits) == (4, 16)
    assert plan.provenance.predicted_loss == pytest.approx(0.8)
    assert plan.provenance.predicted_bytes == 9
    assert plan.provenance.note == "2 greedy upgrades"


def test_greedy_steps_in_order():
    S = np.array([[[[LOSS[l][(k, kb, vb)] for vb in (4, 16)] for kb in (4, 16)] for k in (0.5, 1.0)]
                  for l in range(2)])
    m = np.array([[[2 * (kb + vb) * (1 if k == 0.5 else 2) for vb in (4, 16)] for kb in (4, 16)] for k in (0.5, 1.0)])
    pos, steps = moend_greedy(S, m, 72)
    assert steps == [(1, 2), (0, 0)]
    assert pos.tolist() == [[1, 0, 0], [0, 0, 1]]
    # with room for everything it keeps upgrading while the loss falls
    pos, steps = moend_greedy(S, m, 10_000)
    assert [S[(l, *pos[l])] for l in range(2)] == [0.0, 0.0]


def test_greedy_fails_with_minimum_feasible_budget():
    with pytest.raises(SolverError, match=r"minimum feasible budget is 4 bytes"):
        solve(hand_profile(), Budget.of_bytes(3, 4), "moend-greedy")
    solve(hand_profile(), Budget.of_bytes(4, 4), "moend-greedy")


def test_greedy_needs_a_complete_grid_and_one_rule():
    configs = moend_configs("tova", **AXES)[:-1]
    p = Profile.from_table(np.ones((2, 7)), configs, (2, 1, 1))
    with pytest.raises(SolverError, match=r"no config keep=1 K4 V4"):
        solve(p, Budget.of_bytes(100, 4), "moend-greedy")
    two = moend_configs("tova", **AXES) + moend_configs("h2o", **AXES)
    p = Profile.from_table(np.ones((2, 16)), two, (2, 1, 1))
    with pytest.raises(SolverError, match=r"choose one with --param rule=NAME"):
        solve(p, Budget.of_bytes(100, 4), "moend-greedy")
    assert solve(p, Budget.of_bytes(100, 4), "moend-greedy", rule="h2o").provenance.params["rule"] == "h2o"


def test_unknown_solver_parameter_is_an_error():
    with pytest.raises(SolverError, match=r"no parameter\(s\) \['bogus'\]"):
        solve(hand_profile(), Budget.of_bytes(9, 4), "moend-greedy", bogus=3)
