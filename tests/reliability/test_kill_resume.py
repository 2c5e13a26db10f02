"""kill -9 of a running `polykv study` loses nothing: the rerun resumes (the lock died with the killed
process), runs only what is missing, and ends with the same records as a run never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from cases import plan_dict, spec_dict, write

from polykv.studies.results import read_records

pytestmark = pytest.mark.slow  # kills and restarts a study process


def _study(folder, results, *extra):
    return [sys.executable, "-m", "polykv", "study", str(folder / "spec.json"), "--results", str(results),
            "--no-progress", "--threads", "1", *extra]


def _view(records):
    return sorted((r["policy"], r["item"], r["score"], r["kv_bytes"], r["generated"]) for r in records
                  if r["kind"] == "result")


def test_kill_9_mid_study_then_resume(tmp_path):
    write(tmp_path, "plan.json", plan_dict())
    spec = spec_dict()
    spec["tasks"][0]["samples"] = 6
    write(tmp_path, "spec.json", spec)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    whole = tmp_path / "whole.jsonl"
    subprocess.run(_study(tmp_path, whole), check=True, env=env, capture_output=True, timeout=900)
    total = len([r for r in read_records(str(whole)) if r["kind"] == "result"])
    assert total == 12

    cut = tmp_path / "cut.jsonl"
    proc = subprocess.Popen(_study(tmp_path, cut), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while time.time() < deadline:
        done = cut.read_text().count('"kind": "result"') if cut.exists() else 0
        if done >= 3 or proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    before = [r for r in read_records(str(cut)) if r["kind"] == "result"]
    assert 0 < len(before) < total, "the study was killed mid-run"

    out = subprocess.run(_study(tmp_path, cut), env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert f"skipped {len(before)} already recorded" in out.stdout
    records = read_records(str(cut))
    keys = Counter((r["policy"], r["task"], r["item"]) for r in records if r["kind"] == "result")
    assert len(keys) == total and max(keys.values()) == 1
    assert _view(records) == _view(read_records(str(whole)))
    assert all(line.endswith("\n") for line in cut.read_text().splitlines(keepends=True))
    assert json.loads(cut.read_text().splitlines()[0])["kind"] == "header"
