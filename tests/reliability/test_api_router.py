"""Bad input to the solvers that choose an allocation group (``global``, ``refine`` with ``start`` and ``objectives``),
to the plan meter's scored rows and weights, and to the end-to-end rank pricing, through the Python API: one clear
line each, naming the parameter."""

from __future__ import annotations

import os

import attrs
import numpy as np
import pytest
import torch

from polykv.errors import ProfileError, RuntimeConfigError, SolverError
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate_axes import with_ranks
from polykv.profiling.plan_meter import PlanMeter
from polykv.profiling.profile import CandidateConfig, Profile, load_profile, moend_configs
from polykv.registry import get_registry
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn
from polykv.testing import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE_2048 = os.path.join(ROOT, "bench", "high_compression", "profiles", "smollm2-135m-instruct-2048.profile.json")
BUDGET_8X = Budget.parse("8x", 2048, basis="resident", cache_dtype="bfloat16")


@pytest.mark.parametrize("params, needle", [
    ({"allocator": "nope"}, "allocator"), ({"allocator": 3}, "allocator"),
    ({"allocator": "pyramidkv", "rule": "random"}, "has no configs"),
    ({"rule": "snapkv"}, "group's rule must be 'kvzip'"), ({"rules": ["snapkv"]}, "leaves out the group's rule"),
    ({"shares": "even"}, "shares"), ({"k_bits": 2}, "K2"), ({"k_bits": 3}, "k_bits"),
    ({"allocator": "pyramidkv"}, "pyramidkv"), ({"metric": "kl_mix"}, "kl_mix"), ({"group": 1}, "group")])
def test_global_refuses_bad_parameters_in_one_line(params, needle):
    with pytest.raises((SolverError, ProfileError)) as info:
        solve(load_profile(PROFILE_2048), BUDGET_8X, "global", **{"allocator": "kvzip", **params})
    assert needle in str(info.value) and "\n" not in str(info.value), params


def test_global_names_the_minimum_budget_when_nothing_fits():
    with pytest.raises(SolverError, match="minimum feasible budget|raise the budget"):
        solve(load_profile(PROFILE_2048), Budget.of_bytes(1000, 2048, basis="resident"), "global", allocator="kvzip")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)


def _profile(model) -> Profile:
    from polykv.models.geometry import geometry_of_model

    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in moend_configs("snapkv", "prefill", keeps=(0.5, 1.0), k_bits=(16,), v_bits=(16,))]
    return Profile.from_table(np.random.default_rng(0).random((2, len(configs))), configs, geometry_of_model(model))


@pytest.mark.parametrize("params, needle", [
    ({"start": "greedy"}, "start"), ({"start": "global", "allocator": "nope"}, "allocator"),
    ({"start": "global"}, "allocator"),
    ({"start": "global", "allocator": "pyramidkv"}, "no configs"), ({"objectives": ["recall"]}, "objectives"),
    ({"objectives": 3}, "objectives"), ({"objectives": []}, "objectives")])
def test_refine_refuses_bad_start_and_objectives_in_one_line(tiny, params, needle):
    base = {"tokens": 32, "follow_up": 8, "sequences": 1}
    with pytest.raises(SolverError) as info:
        solve(_profile(tiny), Budget.parse("2x", 32, basis="resident"), "refine",
              model=MeasureOn(model=tiny, tokenizer=None), **base, **params)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kw", [{"rows": [[0]]}, {"weights": [1.0, 1.0, 1.0]}])
def test_plan_meter_needs_one_weight_and_one_row_list_per_sequence(tiny, kw):
    seqs = [torch.randint(1, 128, (20,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with pytest.raises(RuntimeConfigError, match="one weight and one list of scored rows per sequence"):
        PlanMeter(tiny, seqs, 10, **kw)


def test_ranks_need_a_measurement_in_every_metric(tiny):
    prof = _profile(tiny)
    prof = attrs.evolve(prof, metrics={"l2": prof.table(), "kl": prof.table()})
    quantizer = get_registry().quantizer("kivi")()
    with pytest.raises(ProfileError, match=r"not measured in metric\(s\) \['kl'\]"):
        with_ranks(prof, {"l2": np.zeros((2, 1))}, [(16, None)], quantizer)


def test_exact_refuses_ranks_priced_in_l2_only_on_the_mix(tiny):
    prof = _profile(tiny)
    low = CandidateConfig(rule="full", keep=1.0, k_rank=16, v_rank=16)
    table = np.column_stack([prof.table(), [0.1, 0.2]])
    prof = attrs.evolve(prof, configs=list(prof.configs) + [low],
                        metrics={"l2": table, "kl": table, "kl_retrieval": table, "kl_mix": 2 * table},
                        objective_weights={"kl": 1.0, "kl_retrieval": 1.0}, routing_metric="kl_mix")
    with pytest.raises(SolverError, match="low-rank configs in metric 'l2' only, not 'kl_mix'.*--metric l2"):
        solve(prof, Budget.parse("2x", 64, basis="resident"), "exact")
