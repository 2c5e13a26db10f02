"""Studies on Ray: the same records as a serial run, a killed worker's item rerun and never duplicated."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
import torch

from polykv.cli import main as cli_main
from polykv.studies.distributed import run_study_ray
from polykv.studies.results import read_records
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec

pytestmark = pytest.mark.slow  # starts a local Ray

RESULTS = 3 * (3 + 1)
"""3 policies (full, snapkv, h2o) x (3 passkey + 1 continuation items)."""


@pytest.fixture(scope="module")
def serial(tmp_path_factory, tiny_spec):
    """(spec path, the records of a serial run of it with one torch thread, as the workers use)."""
    folder = tmp_path_factory.mktemp("ray-study")
    spec_path = tiny_spec(str(folder), passkey_samples=3, continuation_samples=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same float sums, hence the same bits
    try:
        run_study(prepare(load_spec(spec_path), str(folder / "serial.jsonl")), progress=False)
    finally:
        torch.set_num_threads(threads)
    return spec_path, read_records(str(folder / "serial.jsonl"))


def test_ray_run_writes_the_serial_records(tmp_path, local_ray, serial, same_records, capsys):
    spec_path, reference = serial
    results = str(tmp_path / "ray.jsonl")
    assert cli_main(["study", spec_path, "--results", results, "--ray", "--workers", "2", "--threads", "1",
                     "--no-progress"]) == 0
    assert "2 Ray workers" in capsys.readouterr().out
    records = read_records(results)
    assert same_records(records, reference)
    assert {r["reused_prefill"] for r in records if r["kind"] == "result"} == {True}
    # resume reads it like a serial file: a second run finds nothing left to do
    assert run_study(prepare(load_spec(spec_path), results), progress=False) == {"run": 0, "skipped": RESULTS}


class Stop(Exception):
    """Raised from the result callback: the serial run dies between two records."""


def test_a_killed_worker_has_its_item_rerun_and_nothing_duplicated(tmp_path, local_ray, serial, same_records):
    spec_path, reference = serial
    spec, results = load_spec(spec_path), str(tmp_path / "ray.jsonl")
    seen = []

    def stop_after_four(record):
        seen.append(record)
        if len(seen) == 4:  # the first item's 3 policies and one of the second's
            raise Stop

    with pytest.raises(Stop):
        run_study(prepare(spec, results), progress=False, on_result=stop_after_four)

    sent, killed = [], []

    def kill_on_second_dispatch(pid, unit):
        sent.append(unit)
        if len(sent) == 2:  # that worker has just been sent an item: kill it before it can answer
            os.kill(pid, signal.SIGKILL)
            killed.append(unit)

    counts = run_study_ray(prepare(spec, results), workers=2, threads=1, progress=False,
                           on_dispatch=kill_on_second_dispatch)
    assert killed and counts["retried"] == 1 and sent.count(killed[0]) == 2  # sent again after the kill
    assert sent[0][2] == ("snapkv", "h2o")  # Ray resumed the serial file: item 2 lacked only these two
    assert counts["skipped"] == 4 and counts["run"] == RESULTS - 4
    records = read_records(results)
    keys = Counter((r["policy"], r["task"], r["item"]) for r in records if r["kind"] == "result")
    assert len(keys) == RESULTS and max(keys.values()) == 1
    assert same_records(records, reference)
