"""``global``: one allocation group over layers x heads, the other layers per layer, priced by the profile."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import polykv
from polykv.plan import load_plan
from polykv.plan.io import validate_plan
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, load_profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.base import config_bits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HC = os.path.join(ROOT, "bench", "high_compression")
PROFILE_2048 = os.path.join(HC, "profiles", "smollm2-135m-instruct-2048.profile.json")
GEMMA_2048 = os.path.join(HC, "profiles", "gemma3-270m-2048.profile.json")


def _budget(text: str) -> Budget:
    return Budget.parse(text, 2048, basis="resident", cache_dtype="bfloat16")


@pytest.mark.parametrize("ratio", ["4x", "8x", "12x", "16x"])
def test_the_shipped_kvzip_global_plans_are_what_the_solver_writes(ratio):
    shipped = load_plan(os.path.join(HC, "plans", f"kvzip-global.{ratio}.plan.json"))
    plan = solve(load_profile(PROFILE_2048), _budget(ratio), "global", allocator="kvzip", rules=["kvzip"], shares="uniform",
                 k_bits=4, v_bits=4)
    assert plan.layers == shipped.layers
    assert plan.allocation == shipped.allocation
    assert [g.layers for g in plan.allocation] == [tuple(range(30))]
    assert shipped.provenance.solver == "global"


def test_gemma_groups_name_the_full_attention_layers_of_the_whole_model():
    shipped = load_plan(os.path.join(HC, "plans", "gemma3-270m.kvzip-global.8x.plan.json"))
    plan = solve(load_profile(GEMMA_2048), _budget("8x"), "global", allocator="kvzip", rules=["kvzip"], shares="uniform",
                 k_bits=4, v_bits=4)
    assert plan.allocation == shipped.allocation
    assert plan.allocation[0].layers == (5, 11, 17)
    assert "over layers 5, 11, 17" in plan.provenance.note
    assert all(plan.layers[i].keeps_everything for i in range(18) if i not in (5, 11, 17))


@pytest.mark.parametrize("ratio", ["8x", "12x", "16x"])
def test_the_profiled_split_is_no_worse_than_the_uniform_share_by_the_profile(ratio):
    profile = load_profile(PROFILE_2048)
    uniform = solve(profile, _budget(ratio), "global", allocator="kvzip", rules=["kvzip"], shares="uniform",
                    k_bits=4, v_bits=4)
    split = solve(profile, _budget(ratio), "global", allocator="kvzip", rules=["kvzip"])
    assert split.provenance.predicted_loss < uniform.provenance.predicted_loss
    assert split.provenance.predicted_bytes <= _budget(ratio).to_bytes(profile.model)
    members = split.allocation[0].layers
    stored = {(split.layers[i].k_bits, split.layers[i].v_bits) for i in members}
    assert len(stored) == 1                                   # members share one storage signature
    validate_plan(split, registry=polykv.get_registry())


def _toy_profile(seed: int) -> Profile:
    """Three layers, a group rule ('kvzip') and another ('snapkv') at two keeps and two width pairs each."""
    configs = [c for rule in ("kvzip", "snapkv") for c in moend_configs(rule, "prefill", keeps=(0.25, 0.5, 1.0),
                                                                       k_bits=(16, 4), v_bits=(16, 4))]
    seen, unique = set(), []
    for c in configs:
        if c.label not in seen:
            seen.add(c.label)
            unique.append(c)
    table = np.random.default_rng(seed).random((3, len(unique)))
    model = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 64, "num_heads": 4}
    return Profile.from_table(table, unique, model)


def _brute_force(profile: Profile, budget: Budget) -> float:
    """Lowest summed loss over every assignment in which the layers evicting with 'kvzip' store alike."""
    table, bits = profile.table(), config_bits(profile, budget)
    cap, best = budget.to_bits(profile.model), np.inf
    for choice in itertools.product(range(len(profile.configs)), repeat=profile.num_layers):
        kv = {(profile.configs[c].k_bits, profile.configs[c].v_bits) for c in choice
              if profile.configs[c].rule == "kvzip" and not profile.configs[c].keeps_everything}
        if len(kv) <= 1 and sum(bits[c] for c in choice) <= cap:
            best = min(best, float(sum(table[i, c] for i, c in enumerate(choice))))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio", ["2x", "5x"])
def test_the_plan_is_the_optimum_with_one_signature_for_the_group(seed, ratio):
    profile = _toy_profile(seed)
    budget = Budget.parse(ratio, 256, basis="nominal")
    plan = solve(profile, budget, "global", allocator="kvzip")
    assert plan.provenance.predicted_loss == pytest.approx(_brute_force(profile, budget), rel=1e-9)
    members = [lp.layer for lp in plan.layers if lp.prefill.rule == "kvzip"]
    assert [list(g.layers) for g in plan.allocation] == ([members] if members else [])
    assert len({(plan.layers[i].k_bits, plan.layers[i].v_bits) for i in members}) <= 1
