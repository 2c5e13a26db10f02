"""Every bad input gets one clear line: exit 2, ``polykv VERB: error: ...`` naming the file or field, no
traceback, no output file left behind, no existing file touched, no hang (see cases.py for the table).

The CLI runs in-process (``polykv.cli.main``), so the whole table takes seconds; a few cases also run
through a real ``python -m polykv`` subprocess at the end.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from cases import CASES, SHIPPED_PLAN, _HELD, plan_dict, write
from harness import CLASSES, classify

TALLY: collections.Counter = collections.Counter()
FAILURES: dict[str, str] = {}


def test_the_table_is_large_and_covers_every_kind_of_input():
    groups = collections.Counter(c.group for c in CASES)
    assert len(CASES) >= 250, groups
    assert {"plan", "profile", "spec", "taskfile", "cli"} <= set(groups)
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_gets_one_clear_line(case, tmp_path):
    argv = case.setup(tmp_path)
    try:
        cls, detail = classify(argv, tmp_path, expect=case.expect, outputs=case.outputs)
    finally:
        while _HELD:
            _HELD.pop().release()
    TALLY[cls] += 1
    if cls != "clear":
        FAILURES[case.id] = f"{cls}: {detail}"
    assert cls == "clear", detail


def test_counts_by_class(request):
    """Printed at the end of the run (``-s``); every class but 'clear' must be empty."""
    if not TALLY:
        pytest.skip("run together with the table")
    summary = ", ".join(f"{c} {TALLY[c]}" for c in CLASSES)
    print(f"\nbad-input table: {sum(TALLY.values())} cases: {summary}")
    for cid, why in sorted(FAILURES.items()):
        print(f"  {cid}: {why}")
    assert sum(TALLY[c] for c in CLASSES if c != "clear") == 0


def _polykv(*args, cwd, stdin=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "polykv", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_real_process_fifo_and_foreign_results_and_self_overwrite(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    notes = write(tmp_path, "notes.txt", "remember the milk")
    plan = write(tmp_path, "plan.json", plan_dict())
    proc = _polykv("plan", "validate", "fifo.json", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a regular file" in proc.stderr
    proc = _polykv("report", notes, "-o", notes, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert open(notes).read() == "remember the milk"
    proc = _polykv("plan", "show", plan, "--context", "0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("polykv plan show: error: --context")


@pytest.mark.slow
def test_debug_variable_shows_the_traceback(tmp_path):
    env = dict(os.environ, POLYKV_DEBUG="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "polykv", "plan", "validate", str(tmp_path / "none.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "PlanError" in proc.stderr


@pytest.mark.slow
def test_piping_into_head_prints_no_broken_pipe_traceback(tmp_path):
    proc = subprocess.run(f"{sys.executable} -m polykv plan show {SHIPPED_PLAN} | head -1", shell=True,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.stdout.startswith("plan ") and proc.stdout.count("\n") == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
