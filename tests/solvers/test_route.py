"""PolyKV routes: top-ranked rule per layer, capacity allocations, count-matched random placements."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from polykv import get_registry
from polykv.errors import SolverError
from polykv.plan import validate_plan
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, StatTable, moend_configs
from polykv.solvers import solve
from polykv.solvers.placements import distinct_placements
from polykv.solvers.route import allocate, random_placements

COS = [[0.9, 0.8, 0.7], [0.5, 0.95, 0.6], [0.2, 0.3, 0.99], [0.9, 0.91, 0.1]]  # columns tova, snapkv, h2o


def route_profile() -> Profile:
    stats = {
        "cosine": StatTable(columns=["tova", "snapkv", "h2o"], values=COS, higher_is_better=True, phase="prefill",
                            capacity=256),
        "entropy": StatTable(columns=["entropy"], values=[[1.0], [3.0], [0.0], [4.0]], higher_is_better=False),
        "delta_ppl": StatTable(columns=["tova", "h2o"], values=[[0.1, 0.2], [1.0, 0.5], [100.0, 0.0], [0.3, 0.4]],
                               higher_is_better=False),
    }
    return Profile.from_table(np.ones((4, 54)), moend_configs("tova"), (4, 1, 8), stats=stats)


def test_route_takes_the_top_ranked_rule_per_layer():
    plan = solve(route_profile(), Budget.of_tokens(100, 1000), "profile-route")
    assert [lp.prefill.rule for lp in plan.layers] == ["tova", "snapkv", "h2o", "snapkv"]
    assert all(lp.prefill.resolve_capacity(1000) == 100 and lp.decode.keeps_everything for lp in plan.layers)
    assert plan.provenance.params["route"] == ["tova", "snapkv", "h2o", "snapkv"]
    validate_plan(plan, registry=get_registry())


def test_both_phase_scope_skips_prefill_only_rules():
    plan = solve(route_profile(), Budget.of_tokens(100, 1000), "profile-route", scope="both")
    # snapkv runs in prefill only, so layers 1 and 3 fall to their best both-phase rule
    assert [lp.prefill.rule for lp in plan.layers] == ["tova", "h2o", "h2o", "tova"]
    assert all(lp.prefill == lp.decode for lp in plan.layers)


def test_lower_is_better_statistics_rank_by_minimum():
    plan = solve(route_profile(), Budget.of_tokens(100, 1000), "profile-route", statistic="delta_ppl",
                 scope="decode")
    assert [lp.decode.rule for lp in plan.layers] == ["tova", "h2o", "h2o", "tova"]
    assert all(lp.prefill.keeps_everything for lp in plan.layers)


def test_allocations_split_a_fixed_total():
    p, budget = route_profile(), Budget.of_tokens(100, 1000)
    ent = [lp.prefill.resolve_capacity(1000) for lp in solve(p, budget, "profile-route", allocation="entropy").layers]
    # one token each, then 396 shared 1:3:0:4 = 49.5, 148.5, 0, 198; the spare token goes to the first .5
    assert ent == [51, 149, 1, 199]
    dp = [lp.prefill.resolve_capacity(1000) for lp in solve(p, budget, "profile-route", allocation="delta-ppl").layers]
    # per-layer max 0.2, 1.0, 100, 0.4; 100 is clipped to the 95th percentile 85.15, then 396 shared:
    # 0.913, 4.565, 388.70, 1.826 (+1 each), largest remainders take the 3 spare tokens
    assert dp == [2, 5, 390, 3]
    unclipped = [lp.prefill.resolve_capacity(1000) for lp in solve(p, budget, "profile-route", allocation="delta-ppl",
                                                     clip_percentile=100).layers]
    assert unclipped[2] > dp[2]


def test_allocate_caps_at_the_context_and_rounds_exactly():
    assert allocate(10, np.array([1.0, 1.0, 1.0]), 4) == [4, 3, 3]
    out = allocate(25, np.array([100.0, 1.0, 1.0]), 10)
    assert out[0] == 10 and sum(out) == 25 and max(out) <= 10
    assert allocate(100, np.array([1.0, 2.0]), 10) == [10, 10]
    assert allocate(7, np.array([0.0, 0.0, 0.0]), 10) == [3, 2, 2]


def test_random_placements_are_unique_count_matched_and_seeded():
    route = ["tova"] * 3 + ["h2o"] * 2 + ["snapkv"]
    assert distinct_placements(route) == 60
    got = random_placements(route, 59, seed=1)
    assert len({tuple(g) for g in got}) == 59 and tuple(route) not in {tuple(g) for g in got}
    assert all(Counter(g) == Counter(route) for g in got)
    assert random_placements(route, 10, seed=1) == random_placements(route, 10, seed=1)
    assert random_placements(route, 10, seed=1) != random_placements(route, 10, seed=2)
    with pytest.raises(SolverError, match="only 59 placements differ"):
        random_placements(route, 60, seed=0)
    long = ["tova"] * 14 + ["h2o"] * 14  # 40 million placements: sampled, not enumerated
    assert len({tuple(g) for g in random_placements(long, 99, seed=0)}) == 99


def test_random_placement_solver_permutes_the_guided_route():
    p, budget = route_profile(), Budget.of_tokens(100, 1000)
    guided = [lp.prefill.rule for lp in solve(p, budget, "profile-route").layers]
    plans = [solve(p, budget, "random-placement", count=11, index=i) for i in range(11)]
    routes = [tuple(lp.prefill.rule for lp in plan.layers) for plan in plans]
    assert len(set(routes)) == 11 and tuple(guided) not in routes
    assert all(Counter(r) == Counter(guided) for r in routes)
    assert plans[0].provenance.params["guided_route"] == guided
    with pytest.raises(SolverError, match="index 11 is outside"):
        solve(p, budget, "random-placement", count=11, index=11)


def test_a_statistic_column_naming_no_installed_rule_is_an_error():
    p = route_profile()
    stats = dict(p.stats, cosine=StatTable(columns=["tova", "mystery"], values=np.ones((4, 2)),
                                           higher_is_better=True))
    bad = Profile(model=p.model, configs=p.configs, metrics=p.metrics, stats=stats)
    with pytest.raises(SolverError, match=r"stats.cosine column 'mystery': unknown rule 'mystery'"):
        solve(bad, Budget.of_tokens(100, 1000), "profile-route")
