"""Python-API bad input to the rank and layer-pair axes of profiles and solving: one clear exception each, naming
the field or parameter."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from polykv.commands.calibrate import parse_ranks
from polykv.errors import ProfileError, SolverError
from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, PairTable, Profile
from polykv.solvers import solve
from polykv.solvers.chain import solve_chain


def _profile(**changes) -> Profile:
    configs = [CandidateConfig(rule="full", keep=1.0), CandidateConfig(rule="full", keep=1.0, k_rank=16, v_rank=16)]
    prof = Profile.from_table(np.array([[0.0, 0.2]] * 3), configs, (3, 2, 32))
    return attrs.evolve(prof, **changes)


@pytest.mark.parametrize("pairs, field", [
    (PairTable(uppers=[0], values=[[0.1, 0.1]]), "pairs.uppers"),
    (PairTable(uppers=[3], values=[[0.1, 0.1]]), "pairs.uppers"),
    (PairTable(uppers=[2, 1], values=[[0.1, 0.1], [0.1, 0.1]]), "pairs.uppers"),
    (PairTable(uppers=[1, 2], values=[[0.1, 0.1]]), "pairs.values"),
    (PairTable(uppers=[1], values=[[0.1, np.nan]]), "pairs.values"),
    (PairTable(uppers=[1], values=[[0.1, -0.5]]), "pairs.values"),
    (PairTable(uppers=[1], values=[[0.1, 0.1]], share_params={"colour": 1}), "pairs.share_params"),
])
def test_bad_pair_tables_are_refused_naming_the_field(pairs, field):
    with pytest.raises(ProfileError, match=f"field '{field}'"):
        _profile(pairs=pairs)


@pytest.mark.parametrize("name, value", [("k_rank", 33), ("v_rank", 0), ("k_rank", 1.5)])
def test_a_rank_outside_the_head_dim_is_refused(name, value):
    configs = [CandidateConfig(rule="full", keep=1.0), CandidateConfig(rule="full", keep=1.0, **{name: value})]
    with pytest.raises(ProfileError, match=rf"field 'configs\[1\]\.{name}'"):
        Profile.from_table(np.zeros((3, 2)), configs, (3, 2, 32))


def test_the_new_axes_route_on_l2_only():
    prof = _profile(metrics={"l2": np.zeros((3, 2)), "kl": np.zeros((3, 2))})
    with pytest.raises(SolverError, match="'l2' only.*--metric l2"):
        solve(prof, Budget.parse("1x", 64, basis="resident"), "exact", metric="kl")


def test_chain_solver_refuses_negative_weights():
    with pytest.raises(SolverError, match="non-negative"):
        solve_chain(np.zeros((2, 1)), np.array([[1], [-1]]), 10, np.array([np.nan, 0.1]), np.array([0, 2]))


@pytest.mark.parametrize("text, match", [("3d/2", "not a fraction of d"), ("d/0", "not a fraction of d"),
                                         ("65", "channel count in 1..64"), ("half", "neither d"), ("", "neither d")])
def test_bad_ranks_option(text, match):
    with pytest.raises(ProfileError, match=match):
        parse_ranks(text, 64)


def test_ranks_option_reads_fractions_and_counts():
    assert parse_ranks("d,3d/4,d/2,d/4", 64) == (None, 48, 32, 16)
    assert parse_ranks("24,d,d", 64) == (24, None)
