"""Helpers for solver tests: small profiles on a keep x K x V grid, and brute force."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from polykv.profiling.budget import layer_bits
from polykv.profiling.profile import Profile, moend_configs


def grid_profile(table, *, rule="tova", phase="both", keeps=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0), k_bits=(16, 8, 4),
                 v_bits=(16, 8, 4), dims=(None, 2, 16)) -> Profile:
    table = np.asarray(table, dtype=np.float64)
    configs = moend_configs(rule, phase, keeps=keeps, k_bits=k_bits, v_bits=v_bits)
    return Profile.from_table(table, configs, (table.shape[0], dims[1], dims[2]))


def monotone_table(rng, L, configs) -> np.ndarray:
    """Loss that strictly falls with keep and with each bit width, zero at keep 1.0 / K16 / V16."""
    a, b, c = rng.uniform(0.1, 1.0, (3, L, 1))
    keep = np.array([cf.keep for cf in configs])
    kb = np.array([cf.k_bits for cf in configs])
    vb = np.array([cf.v_bits for cf in configs])
    return a * (1 - keep) + b * np.log2(16 / kb) + c * np.log2(16 / vb)


def brute_force(profile: Profile, budget) -> float | None:
    """Minimum summed loss over every assignment of configs to layers within the budget (None if none fits)."""
    table = profile.table()
    T = budget.context_tokens
    bits = np.array([layer_bits(profile.model, c.keep, c.k_bits, c.v_bits, T) for c in profile.configs])
    cap = budget.to_bits(profile.model)
    best = None
    for choice in itertools.product(range(len(profile.configs)), repeat=profile.num_layers):
        if sum(bits[c] for c in choice) <= cap:
            s = float(sum(table[l, c] for l, c in enumerate(choice)))
            best = s if best is None or s < best else best
    return best


def plan_bits(plan, profile: Profile, T: int) -> int:
    """Nominal bits of a plan's layers once generation runs, from polykv.memory (not the solver's count)."""
    from polykv.memory import kept_tokens
    from polykv.profiling.budget import slot_bits

    return sum(kept_tokens(lp, T, "decode") * slot_bits(profile.model, lp.k_bits, lp.v_bits) for lp in plan.layers)


@pytest.fixture(scope="session")
def kit():
    return types.SimpleNamespace(grid_profile=grid_profile, monotone_table=monotone_table, brute_force=brute_force,
                                 plan_bits=plan_bits)
