"""Shared set-up of the study runner tests: a tiny model's profile and a spec file that uses it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polykv.models.geometry import geometry_of_model
from polykv.profiling.profile import CandidateConfig, Profile, StatTable, moend_configs
from polykv.testing import tiny_model

TINY = {"family": "llama", "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 128, "seed": 0}


def tiny_profile() -> Profile:
    """A hand-made profile of the tiny model: a MoE-nD table for snapkv and a per-rule cosine table."""
    model = tiny_model(**TINY)
    geo = geometry_of_model(model)
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 1.0), k_bits=(16, 8, 4), v_bits=(16, 8, 4))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    rng = np.random.default_rng(0)
    L = geo.num_layers
    base = np.array([(1 - c.keep) + (16 - c.k_bits) / 40 + (16 - c.v_bits) / 60 for c in configs])
    table = base[None, :] * rng.uniform(0.5, 1.5, size=(L, 1))
    cosine = StatTable(columns=("snapkv", "tova"), values=[[0.9, 0.8], [0.7, 0.95], [0.85, 0.6], [0.5, 0.9]],
                       higher_is_better=True, phase="prefill", capacity=16)
    return Profile.from_table(table, configs, geo, stats={"cosine": cosine})


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny-profile.json"
    tiny_profile().save(str(path))
    return path


def write_spec(folder, profile_path, **overrides) -> str:
    """A small study spec over the tiny model: full + MoE-nD chain + a route and two placements."""
    spec = {
        "name": "tiny",
        "model": {"tiny": TINY},
        "context_tokens": 400,
        "profile": str(profile_path),
        "budgets": ["4x"],
        "baseline": True,
        "solvers": [
            {"name": "2d_uniform", "solver": "uniform", "params": {"mode": "2d_uniform", "rule": "snapkv"}},
            {"name": "2d", "solver": "quant-only", "params": {"rule": "snapkv"}},
            {"name": "2d_hetero", "solver": "exact"},
            {"name": "route", "solver": "profile-route", "role": "routed_uniform"},
            {"name": "random", "solver": "random-placement", "count": 2, "guided": "route"},
        ],
        "tasks": [{"task": "passkey", "params": {"length": 400, "digits": 3, "max_new_tokens": 3},
                   "samples": 3, "seed": 0}],
    }
    spec.update(overrides)
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=1))
    return str(path)


SMALL_SOLVERS = [
    {"name": "2d_hetero", "solver": "exact"},
    {"name": "route", "solver": "profile-route", "role": "routed_uniform"},
]


@pytest.fixture(scope="session")
def small_study(tmp_path_factory, profile_path):
    """A finished small study (full, 2d_hetero, route x 3 passkey items): (spec path, results path, records)."""
    from polykv.studies.results import read_records
    from polykv.studies.runner import prepare, run_study
    from polykv.studies.spec import load_spec

    folder = tmp_path_factory.mktemp("small")
    spec_path = write_spec(folder, profile_path, solvers=SMALL_SOLVERS)
    results = str(folder / "results.jsonl")
    run_study(prepare(load_spec(spec_path), results), progress=False)
    return spec_path, results, read_records(results)


def result_view(records) -> dict:
    """(policy, task, item) -> what must not change between equivalent runs."""
    return {(r["policy"], r["task"], r["item"]): (r["score"], r["generated"], r["kv_bytes"], r["kv_bytes_per_layer"],
                                                  r["kv_bytes_end"], r["context_tokens"])
            for r in records if r["kind"] == "result"}


@pytest.fixture
def spec_writer(profile_path):
    """``spec_writer(folder, **overrides)`` -> path of a spec over the small policy set (see SMALL_SOLVERS)."""
    def write(folder, **overrides):
        return write_spec(folder, profile_path, **{"solvers": SMALL_SOLVERS, **overrides})
    return write


@pytest.fixture
def view():
    """The :func:`result_view` of a list of records."""
    return result_view
