"""The shipped RULER studies (examples/ruler_study.json at 4k, examples/ruler_study_8k.json at 8k) run every
synthetic RULER task, each prompt sized as RULER sizes it: the budget less the task's generated tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from polykv.registry import get_registry
from polykv.studies.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
SPECS = {4096: ROOT / "examples" / "ruler_study.json", 8192: ROOT / "examples" / "ruler_study_8k.json"}
RULER_TASKS = {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "cwe", "fwe"}


@pytest.mark.parametrize("budget", sorted(SPECS))
def test_every_synthetic_ruler_task_at_the_budget(budget):
    spec = load_spec(str(SPECS[budget]))
    assert spec.model == "default" and spec.context_tokens == budget and spec.baseline
    assert {t.task for t in spec.tasks} == RULER_TASKS
    for t in spec.tasks:
        params = get_registry().task(t.task)().params(**t.params)
        assert params["length"] + params["max_new_tokens"] == budget, t.task
        assert t.samples >= 20


@pytest.mark.model
@pytest.mark.parametrize("budget", sorted(SPECS))
def test_the_shipped_ruler_studies_check_against_the_default_model(budget, tmp_path, capsys):
    from polykv.cli import main

    assert main(["study", str(SPECS[budget]), "--check", "--results", str(tmp_path / "r.jsonl")]) == 0
    assert "7 policies x 140 items" in capsys.readouterr().out
