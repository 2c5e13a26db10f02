"""The high-compression study is one spec (examples/high_compression_study.json), run in parts
(bench/high_compression/*.json) that `polykv report` combines: every part must be a piece of the whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polykv.studies.combine import SAME_EXPERIMENT
from polykv.studies.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
WHOLE = ROOT / "examples" / "high_compression_study.json"
PARTS = sorted((ROOT / "bench" / "high_compression").glob("*.json"))


@pytest.fixture(scope="module")
def whole():
    return load_spec(str(WHOLE))


def test_the_whole_study_has_every_policy_the_issue_names(whole):
    tasks = {t.task for t in whole.tasks}
    assert tasks == {"passkey", "niah", "variable_tracking"} and all(t.samples == 20 for t in whole.tasks)
    assert whole.budgets == ("4x", "8x", "12x", "16x") and whole.basis == "resident" and whole.baseline
    solvers = {s.name: s.solver for s in whole.solvers}
    assert solvers["joint"] == "exact" and solvers["2d_hetero"] == "moend-greedy"
    for rule in ("snapkv", "tova", "streamingllm", "h2o", "triattention", "adakv"):
        assert solvers[f"uniform-{rule}"] == "uniform"
    for name in ("kvzip-uniform", "kvzip-global", "uniform-keydiff", "uniform-expected-attention", "refine"):
        assert all(f"{name}@{b}" in whole.plans for b in whole.budgets)


@pytest.mark.parametrize("part", PARTS, ids=[p.name for p in PARTS])
def test_each_part_is_a_piece_of_the_whole(whole, part):
    spec = load_spec(str(part))
    for field in SAME_EXPERIMENT:
        assert getattr(spec, field) == getattr(whole, field), field
    tasks = {t.task: t for t in whole.tasks}
    for t in spec.tasks:
        assert t == tasks[t.task]
    solvers = {s.name: s for s in whole.solvers}
    if spec.solvers:  # solved from the same profile
        assert os.path.samefile(spec.profile, whole.profile)
    for s in spec.solvers:
        assert s == solvers[s.name]
    assert set(spec.budgets) <= set(whole.budgets)
    for name, path in spec.plans.items():
        assert os.path.samefile(path, whole.plans[name]), name


def test_the_gemma3_passkey_part_runs_the_same_design_on_gemma3(whole):
    """The issue's passkey part on Gemma 3 270M: the same task, budgets and designs, from a 2,048-token profile."""
    spec = load_spec(str(ROOT / "examples" / "high_compression_gemma3_study.json"))
    assert spec.model == "gemma3-270m" and spec.baseline
    for field in ("budgets", "basis", "storage_dtype", "context_tokens", "dtype"):
        assert getattr(spec, field) == getattr(whole, field), field
    passkey = {t.task: t for t in whole.tasks}["passkey"]
    assert list(spec.tasks) == [passkey]
    solvers = {s.name: s for s in spec.solvers}
    theirs = {s.name: s for s in whole.solvers}
    for name in ("uniform-snapkv", "uniform-tova", "uniform-streamingllm", "uniform-h2o", "2d_hetero", "joint"):
        assert solvers[name] == theirs[name], name
    assert solvers["uniform-kvzip"].solver == "uniform" and solvers["uniform-kvzip"].params["rule"] == "kvzip"
    for name in ("kvzip-global", "refine"):
        assert all(os.path.isfile(spec.plans[f"{name}@{b}"]) for b in spec.budgets)
