"""Studies on Ray: the same records as a serial run, a killed worker's item rerun and never duplicated."""

from __future__ import annotations

import os
import signal
from collections import Counter

import torch

from polykv.cli import main as cli_main
from polykv.studies.distributed import run_study_ray
from polykv.studies.results import read_records
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec


def _serial(spec_path, results):
    torch.set_num_threads(1)  # the workers' thread count: the same float sums, hence the same bits
    run_study(prepare(load_spec(spec_path), results), progress=False)
    return read_records(results)


def test_ray_run_writes_the_serial_records(tmp_path, local_ray, capsys, tiny_spec, same_records):
    spec_path = tiny_spec(str(tmp_path))
    serial = _serial(spec_path, str(tmp_path / "serial.jsonl"))
    ray_results = str(tmp_path / "ray.jsonl")
    assert cli_main(["study", spec_path, "--results", ray_results, "--ray", "--workers", "2", "--threads", "1",
                     "--no-progress"]) == 0
    assert "2 Ray workers" in capsys.readouterr().out
    on_ray = read_records(ray_results)
    assert same_records(on_ray, serial)
    results = [r for r in on_ray if r["kind"] == "result"]
    assert len(results) == 3 * (3 + 2) and {r["reused_prefill"] for r in results} == {True}
    # resume and report read it like a serial file: a second run finds nothing to do
    assert run_study(prepare(load_spec(spec_path), ray_results), progress=False) == {"run": 0, "skipped": 15}


def test_a_killed_worker_has_its_item_rerun_and_nothing_duplicated(tmp_path, local_ray, tiny_spec, same_records):
    spec_path = tiny_spec(str(tmp_path), passkey_samples=4, continuation_samples=1)
    serial = _serial(spec_path, str(tmp_path / "serial.jsonl"))
    results = str(tmp_path / "ray.jsonl")
    # a serial run that stops after the first item: Ray resumes the file
    spec = load_spec(spec_path)
    first = [r for r in serial if r["kind"] == "result"][:3]

    class Stop(Exception):
        pass

    def stop_after_three(record, seen=[]):
        seen.append(record)
        if len(seen) == 3:
            raise Stop

    try:
        run_study(prepare(spec, results), progress=False, on_result=stop_after_three)
    except Stop:
        pass
    assert [r["item"] for r in read_records(results) if r["kind"] == "result"] == [r["item"] for r in first]

    killed = []

    def kill_second_dispatch(pid, unit, sent=[]):
        sent.append(unit)
        if len(sent) == 2:  # the worker has just been sent an item: kill it before it can answer
            os.kill(pid, signal.SIGKILL)
            killed.append(unit)

    counts = run_study_ray(prepare(spec, results), workers=2, threads=1, progress=False,
                           on_dispatch=kill_second_dispatch)
    assert killed and counts["retried"] >= 1
    assert counts["skipped"] == 3 and counts["run"] == 3 * 5 - 3
    records = read_records(results)
    keys = Counter((r["policy"], r["task"], r["item"]) for r in records if r["kind"] == "result")
    assert len(keys) == 15 and max(keys.values()) == 1
    assert same_records(records, serial)
