"""No command destroys a user's file; a results file has one writer; atomic writes clean up after crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from polykv.atomic import clean_stale_temps, write_text_atomic
from polykv.cli import main
from polykv.errors import StudyError
from polykv.studies.results import ResultsLock, ResultsWriter, read_records

RESULT = {"kind": "result", "task": "t", "item": "i-0", "score": 1.0, "kv_bytes": 10, "full_kv_bytes": 20,
          "context_tokens": 4}
"""The fields every result record carries (the reader refuses one without them)."""


def test_a_foreign_one_line_file_is_never_taken_for_a_torn_header(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember the milk")  # one line, no trailing newline: what a torn header looks like
    with pytest.raises(StudyError, match="not a polykv study results file"):
        ResultsWriter.check(str(notes), "spec-1")
    with pytest.raises(StudyError, match="not a polykv study results file"):
        ResultsWriter.open(str(notes), "spec-1", {})
    assert notes.read_text() == "remember the milk"


def test_our_own_torn_header_is_restarted(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"format": "polykv-study-res')
    writer = ResultsWriter.open(str(path), "spec-1", {"name": "x"})
    writer.close()
    assert read_records(str(path))[0]["spec_hash"] == "spec-1"


def test_a_refused_run_before_any_result_does_not_block_the_fixed_spec(tmp_path):
    path = str(tmp_path / "r.jsonl")
    with ResultsWriter.open(path, "spec-old", {"name": "x"}) as w:
        w.append({"kind": "policy", "policy": "full"})
    # the spec was fixed (new hash): nothing was measured, so the file is reused without asking
    with ResultsWriter.open(path, "spec-new", {"name": "x"}) as w:
        assert not w.done
    assert read_records(path)[0]["spec_hash"] == "spec-new"
    with ResultsWriter.open(path, "spec-new", {"name": "x"}) as w:
        w.append({"kind": "policy", "policy": "full"})
        w.append(dict(RESULT, policy="full"))
    with pytest.raises(StudyError, match="belongs to another study"):
        ResultsWriter.check(path, "spec-other")


@pytest.mark.slow
def test_a_second_writer_in_another_process_is_refused_naming_the_holder(tmp_path):
    path = str(tmp_path / "r.jsonl")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from polykv.studies.results import ResultsWriter
        w = ResultsWriter.open({path!r}, "spec-1", {{"name": "x"}})
        print("locked", flush=True)
        sys.stdin.readline()
        w.append({{"kind": "policy", "policy": "p"}})
        w.append({{**{RESULT!r}, "policy": "p"}})
        w.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StudyError, match=rf"another polykv study is writing this results file \(pid "
                                             rf"{holder.pid} on host "):
            ResultsWriter.open(path, "spec-1", {"name": "x"})
        with pytest.raises(StudyError, match=f"pid {holder.pid}"):
            ResultsWriter.check(path, "spec-1")  # `prepare` refuses too, before solving anything
    finally:
        holder.communicate("go\n", timeout=120)
    assert holder.returncode == 0
    with ResultsWriter.open(path, "spec-1", {"name": "x"}) as w:  # released: the next run resumes
        assert w.done == {("p", "t", "i-0")}


def test_two_writers_started_together_never_both_write(tmp_path):
    path = str(tmp_path / "r.jsonl")
    first = ResultsWriter.open(path, "spec-1", {"name": "x"})
    try:
        with pytest.raises(StudyError, match=f"pid {os.getpid()}"):
            ResultsWriter.open(path, "spec-1", {"name": "x"})
    finally:
        first.close()
    assert "pid" not in open(path + ".lock").read()  # released locks name no holder


@pytest.mark.slow
def test_atomic_writes_clean_stale_temp_files_of_dead_processes(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".tmp-{dead}-0123abcd-plan.json"
    stale.write_text("half a plan")
    alive = tmp_path / f".tmp-{os.getppid()}-0123abcd-plan.json"  # a live process's temp file stays
    alive.write_text("being written")
    write_text_atomic(str(tmp_path / "plan.json"), "{}\n")
    assert not stale.exists() and alive.exists()
    assert (tmp_path / "plan.json").read_text() == "{}\n"
    assert clean_stale_temps(str(tmp_path)) == []


@pytest.mark.slow
def test_a_killed_solve_leaves_a_temp_file_the_next_run_removes(tmp_path):
    prof = os.path.join(os.path.dirname(__file__), "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
    code = textwrap.dedent(f"""
        import os, polykv.atomic as a
        real = a.os.replace
        def die(src, dst):
            os._exit(9)  # killed between writing the temp file and renaming it
        a.os.replace = die
        from polykv.cli import main
        main(["solve", {prof!r}, "--budget", "8x", "--context", "2048", "-o", "plan.json"])
        """)
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=300)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert not (tmp_path / "plan.json").exists()
    assert main(["solve", prof, "--budget", "8x", "--context", "2048", "-o", str(tmp_path / "plan.json")]) == 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert json.loads((tmp_path / "plan.json").read_text())["schema_version"] == 1


def test_solve_replaces_its_own_plan_but_not_its_profile(tmp_path, capsys):
    prof = os.path.join(os.path.dirname(__file__), "..", "..", "profiles", "smollm2-135m-instruct.profile.json")
    out = str(tmp_path / "p.plan.json")
    assert main(["solve", prof, "--budget", "8x", "--context", "2048", "-o", out]) == 0
    assert main(["solve", prof, "--budget", "4x", "--context", "2048", "-o", out]) == 0  # ours: replaced
    assert json.load(open(out))["provenance"]["budget"] == {"ratio": 4.0}
    capsys.readouterr()
    os.symlink(prof, tmp_path / "alias.json")
    assert main(["solve", prof, "--budget", "8x", "--context", "2048", "-o", str(tmp_path / "alias.json")]) == 2
    assert "also an input" in capsys.readouterr().err


@pytest.mark.slow
def test_the_lock_is_released_when_the_holder_dies(tmp_path):
    path = str(tmp_path / "r.jsonl")
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from polykv.studies.results import ResultsWriter
        ResultsWriter.open({path!r}, "spec-1", {{"name": "x"}})
        os._exit(9)
        """)], timeout=300)
    ResultsLock.acquire(path).release()


def test_a_context_past_the_models_positions_is_warned_about_in_one_line(tmp_path, capsys):
    from cases import plan_dict, spec_dict, write

    write(tmp_path, "plan.json", plan_dict())
    spec = spec_dict()
    spec["context_tokens"] = 5000  # the tiny model has 4096 positions
    path = write(tmp_path, "spec.json", spec)
    assert main(["study", path, "--check", "--results", str(tmp_path / "r.jsonl")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("polykv study: warning: ")
    assert "field 'context_tokens'" in err[0] and "4096 positions" in err[0]
