"""Bad study input fails with a clear error before any model is loaded.

The specs here name a tiny model family that does not exist: loading it would raise a ValueError about
the family, so a StudyError about the bad input proves the input was checked first.
"""

from __future__ import annotations

import json

import pytest

from polykv.cli import main
from polykv.errors import StudyError
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec

UNLOADABLE = {"tiny": {"family": "no-such-family"}}


def _fails(path, results, match):
    with pytest.raises(StudyError, match=match):
        run_study(prepare(load_spec(str(path)), str(results)), progress=False)


@pytest.mark.parametrize("change, match", [
    ({"solvers": [{"name": "x", "solver": "no-such-solver"}]}, r"solvers\[0\]\.solver.*no-such-solver"),
    ({"tasks": [{"task": "no-such-task"}]}, r"tasks\[0\]\.task.*no-such-task"),
    ({"tasks": [{"task": "passkey", "params": {"lenght": 300}}]}, r"tasks\[0\]\.params\.lenght.*unknown key"),
    ({"baseline": False, "tasks": [{"task": "continuation"}]}, r"baseline.*teacher_forced"),
    ({"plans": {"mine": "missing-plan.json"}}, r"plans\.mine.*no such file"),
    ({"budgets": ["eight"]}, r"budgets\[0\].*cannot read budget"),
    ({"solvers": [{"name": "x", "solver": "exact", "params": {"colour": 1}}]}, r"solvers\[0\]\.params.*colour"),
    ({"profile": None}, r"field 'profile'.*need a profile"),
    ({"samples": 3}, r"field 'samples': unknown key"),
    ({"storage_dtype": "int8"}, r"field 'storage_dtype': unknown dtype 'int8'"),
    ({"basis": "codes"}, r"field 'basis': unknown budget basis 'codes'"),
])
def test_bad_spec_fields_are_named_before_the_model_loads(tmp_path, spec_writer, change, match):
    path = spec_writer(tmp_path, model=UNLOADABLE, **change)
    _fails(path, tmp_path / "r.jsonl", match)


def test_a_plan_file_in_the_wrong_format_is_named(tmp_path, spec_writer):
    (tmp_path / "bad-plan.json").write_text(json.dumps({"schema_version": 1, "layers": "all"}))
    path = spec_writer(tmp_path, model=UNLOADABLE, plans={"mine": "bad-plan.json"})
    _fails(path, tmp_path / "r.jsonl", r"plans\.mine.*bad-plan\.json")


def test_a_task_file_in_the_wrong_format_is_named_with_its_line(tmp_path, spec_writer):
    lines = [{"input": "a needle 42.\nWhat is the number?", "outputs": ["42"], "length": 12, "index": 0},
             {"input": "no outputs", "length": 3, "index": 1}]
    (tmp_path / "ruler.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    path = spec_writer(tmp_path, model=UNLOADABLE,
                       tasks=[{"task": "ruler_file", "params": {"path": "ruler.jsonl"}, "samples": 2}])
    _fails(path, tmp_path / "r.jsonl", r"ruler\.jsonl line 2: missing field\(s\) \['outputs'\]")


def test_a_results_file_from_another_study_is_refused(tmp_path, spec_writer, small_study):
    _, other_results, _ = small_study
    path = spec_writer(tmp_path, model=UNLOADABLE, name="another")
    _fails(path, other_results, r"belongs to another study")


def test_a_file_that_is_not_a_results_file_is_refused(tmp_path, spec_writer):
    (tmp_path / "r.jsonl").write_text('{"hello": 1}\n')
    _fails(spec_writer(tmp_path, model=UNLOADABLE), tmp_path / "r.jsonl", r"not a polykv study results file")


def test_an_unsolvable_budget_names_the_policy(tmp_path, spec_writer):
    path = spec_writer(tmp_path, model=UNLOADABLE, budgets=["100000x"])
    _fails(path, tmp_path / "r.jsonl", r"policy '2d_hetero@100000x'")


def test_a_measuring_solver_entry_says_how_to_solve_its_plans_first(tmp_path, spec_writer):
    """refine measures plans on the model, which a study loads only after solving: the spec is refused with the
    polykv solve command that makes the plan files instead."""
    path = spec_writer(tmp_path, model=UNLOADABLE, solvers=[{"name": "mine", "solver": "refine"}])
    _fails(path, tmp_path / "r.jsonl", r"solver entry 'mine' \(solver 'refine'\) measures its candidate plans.*"
           r"polykv solve PROFILE --budget .* --solver refine --model .* -o mine\..*\.plan\.json.*\"plans\"")


def test_the_cli_prints_the_error_and_exits_2(tmp_path, spec_writer, capsys):
    path = spec_writer(tmp_path, model=UNLOADABLE, tasks=[{"task": "no-such-task"}])
    assert main(["study", path, "--results", str(tmp_path / "r.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no-such-task" in err and "Traceback" not in err
    assert not (tmp_path / "r.jsonl").exists()  # nothing written for a spec that never ran


def test_a_good_spec_reaches_the_model_check(tmp_path, spec_writer):
    # The counterpart of the tests above: with valid input the first failure is the model itself, found
    # from its config (every plan is checked against the model's shape) before any weights load.
    with pytest.raises(StudyError, match="field 'model.tiny'.*no-such-family"):
        run_study(prepare(load_spec(spec_writer(tmp_path, model=UNLOADABLE)), str(tmp_path / "r.jsonl")),
                  progress=False)
    assert not (tmp_path / "r.jsonl").exists()
