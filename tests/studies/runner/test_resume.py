"""An interrupted study resumes where it stopped: nothing finished is lost, nothing is run twice."""

from __future__ import annotations

from collections import Counter

import pytest

from polykv.studies.results import read_records
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec


class Stop(Exception):
    """Raised from the result callback: the study dies between two items, like a killed process."""


def _interrupt_after(n):
    seen = []

    def on_result(record):
        seen.append(record)
        if len(seen) == n:
            raise Stop()
    return on_result


def test_resume_after_interruption_loses_nothing_and_repeats_nothing(tmp_path, spec_writer, view, small_study):
    _, _, reference = small_study
    spec = load_spec(spec_writer(tmp_path))
    results = str(tmp_path / "results.jsonl")
    with pytest.raises(Stop):
        run_study(prepare(spec, results), progress=False, on_result=_interrupt_after(4))
    kept = [r for r in read_records(results) if r["kind"] == "result"]
    assert len(kept) == 4  # every finished result survived the crash

    counts = run_study(prepare(spec, results), progress=False)
    total = len(view(reference))
    assert counts == {"run": total - 4, "skipped": 4}
    records = read_records(results)
    keys = Counter((r["policy"], r["task"], r["item"]) for r in records if r["kind"] == "result")
    assert max(keys.values()) == 1 and len(keys) == total
    assert Counter(r["policy"] for r in records if r["kind"] == "policy") == Counter(
        r["policy"] for r in reference if r["kind"] == "policy")
    assert view(records) == view(reference)  # same scores, texts and bytes as one unbroken run

    again = run_study(prepare(spec, results), progress=False)
    assert again == {"run": 0, "skipped": total}


def test_a_torn_last_line_is_dropped_and_redone(tmp_path, spec_writer, view, small_study):
    _, _, reference = small_study
    spec = load_spec(spec_writer(tmp_path))
    results = str(tmp_path / "results.jsonl")
    with pytest.raises(Stop):
        run_study(prepare(spec, results), progress=False, on_result=_interrupt_after(2))
    with open(results, "a") as fh:  # the process died while writing the third record
        fh.write('{"kind": "result", "policy": "full", "task": "passkey", "item": "passk')
    counts = run_study(prepare(spec, results), progress=False)
    assert counts["skipped"] == 2
    records = read_records(results)
    assert view(records) == view(reference)
    with open(results) as fh:
        assert all(line.endswith("\n") for line in fh)
