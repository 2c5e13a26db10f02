"""Files polykv did not create stay byte-identical; what polykv writes stays where it was asked to write.

The single-call cases (a user's lock file, a foreign figure, a foreign ``.partial`` folder, malformed
results lines) are in the bad-input table (cases_files.py); these are the cases that need two processes,
symlinks followed through, or a check of what was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cases_files import THESIS, good_results, header, policy, result

from polykv.cli import main
from polykv.errors import ProfileError, StudyError
from polykv.profiling.checkpoint import Checkpoint, folder_digest, remove_folder
from polykv.studies.results import Results, ResultsLock, ResultsWriter, read_records


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _tree(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out[os.path.relpath(path, folder)] = _digest(path)
    return out


@pytest.mark.slow
def test_a_study_writing_a_symlink_is_locked_out_by_one_writing_the_file_in_another_process(tmp_path):
    path = str(tmp_path / "r.jsonl")
    os.symlink(path, tmp_path / "link.jsonl")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from polykv.studies.results import ResultsWriter
        w = ResultsWriter.open({path!r}, "spec-1", {{"name": "x"}})
        print("locked", flush=True)
        sys.stdin.readline()
        w.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for other in (str(tmp_path / "link.jsonl"), str(tmp_path / "sub" / ".." / "r.jsonl")):
            os.makedirs(tmp_path / "sub", exist_ok=True)
            with pytest.raises(StudyError, match=f"another polykv study is writing this results file \\(pid "
                                                 f"{holder.pid} "):
                ResultsWriter.open(other, "spec-1", {"name": "x"})
    finally:
        holder.communicate("go\n", timeout=120)
    assert holder.returncode == 0
    assert not os.path.exists(str(tmp_path / "link.jsonl") + ".lock")  # one lock, beside the resolved path
    with ResultsWriter.open(str(tmp_path / "link.jsonl"), "spec-1", {"name": "x"}) as w:
        w.append(policy())
        w.append(result())
    assert [r["kind"] for r in read_records(path)] == ["header", "policy", "result"]


def test_a_lock_symlinked_to_a_users_file_is_neither_followed_nor_changed(tmp_path):
    thesis = tmp_path / "thesis.txt"
    thesis.write_bytes(b"chapter one\n" * 100)
    before = _digest(thesis)
    os.symlink(thesis, tmp_path / "r.jsonl.lock")
    for call in (lambda: ResultsWriter.open(str(tmp_path / "r.jsonl"), "spec-1", {"name": "x"}),
                 lambda: ResultsWriter.check(str(tmp_path / "r.jsonl"), "spec-1"),
                 lambda: ResultsLock.acquire(str(tmp_path / "r.jsonl"))):
        with pytest.raises(StudyError, match="r.jsonl.lock: a symbolic link"):
            call()
    assert _digest(thesis) == before and os.path.islink(tmp_path / "r.jsonl.lock")
    assert not (tmp_path / "r.jsonl").exists()


def test_a_users_lock_named_file_is_refused_untouched_and_our_own_lock_is_reused(tmp_path):
    lock = tmp_path / "r.jsonl.lock"
    lock.write_bytes(b"pid list for my own script\n")
    with pytest.raises(StudyError, match="is not a results lock file polykv created"):
        ResultsWriter.open(str(tmp_path / "r.jsonl"), "spec-1", {"name": "x"})
    assert lock.read_bytes() == b"pid list for my own script\n"
    lock.unlink()
    ResultsWriter.open(str(tmp_path / "r.jsonl"), "spec-1", {"name": "x"}).close()
    ours = lock.read_bytes()
    ResultsWriter.open(str(tmp_path / "r.jsonl"), "spec-1", {"name": "x"}).close()  # our released lock: reused
    assert lock.read_bytes() == ours and b"pid" not in ours
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_a_lock_left_by_a_killed_older_polykv_is_taken_over(tmp_path):
    (tmp_path / "r.jsonl.lock").write_text("pid 4242 on host lab1 since 2026-11-30T12:00:00Z\n")
    ResultsLock.acquire(str(tmp_path / "r.jsonl")).release()
    assert "pid" not in (tmp_path / "r.jsonl.lock").read_text()


def test_the_writer_refuses_a_record_its_reader_would_refuse_and_writes_nothing(tmp_path):
    path = str(tmp_path / "r.jsonl")
    with ResultsWriter.open(path, "spec-1", {"name": "x"}) as w:
        w.append(policy())
        size = os.path.getsize(path)
        with pytest.raises(StudyError, match="line 3, field 'score'"):
            w.append(result(score=7.5))
        with pytest.raises(StudyError, match="line 3, field 'policy'"):
            w.append(result(name="ghost"))
        assert os.path.getsize(path) == size
        w.append(result())  # the line numbers did not move
    assert len(read_records(path)) == 3


def test_a_torn_last_line_is_still_dropped_but_a_damaged_middle_line_is_not(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(x) for x in (header(), policy(), result(0), result(1))]
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # killed while writing the last line
    assert [r["kind"] for r in read_records(str(path))] == ["header", "policy", "result"]
    path.write_text("\n".join(lines[:2] + [lines[2][:20]] + lines[3:]) + "\n")
    with pytest.raises(StudyError, match=r"r.jsonl line 3: not a JSON record"):
        read_records(str(path))


def test_report_refuses_a_users_figure_before_writing_anything(tmp_path):
    results = good_results(tmp_path)
    (tmp_path / "figs").mkdir()
    mine = tmp_path / "figs" / "passkey-score-vs-memory.png"
    mine.write_bytes(THESIS)
    assert main(["report", results, "-o", str(tmp_path / "figs")]) == 2
    assert mine.read_bytes() == THESIS and sorted(os.listdir(tmp_path / "figs")) == [mine.name]


def test_report_replaces_its_own_figures_on_a_rerun(tmp_path):
    results = good_results(tmp_path, plan=True)
    out = tmp_path / "figs"
    assert main(["report", results, "-o", str(out)]) == 0
    first = sorted(os.listdir(out))
    assert first == ["passkey-score-vs-memory.png", "report.md", "routes-4x.png"]
    assert main(["report", results, "-o", str(out)]) == 0  # ours: recognised and replaced
    assert sorted(os.listdir(out)) == first


def test_a_task_name_that_climbs_out_of_the_report_folder_is_drawn_inside_it(tmp_path):
    base = tmp_path / "deep" / "er"
    base.mkdir(parents=True)
    results = good_results(base, task="../../escaped")
    before = _tree(tmp_path)
    out = base / "figs"
    assert main(["report", results, "-o", str(out)]) == 0
    after = _tree(tmp_path)
    new = sorted(set(after) - set(before))
    assert new and all(p.startswith(os.path.join("deep", "er", "figs") + os.sep) for p in new), new
    assert "escaped-score-vs-memory.png" in os.listdir(out)
    assert "](escaped-score-vs-memory.png)" in (out / "report.md").read_text()
    assert all(after[p] == h for p, h in before.items())


def test_results_with_the_report_fields_read_back_through_the_strict_reader(tmp_path):
    res = Results.load(good_results(tmp_path))
    assert res.policy_names() == ["full", "snapkv@4x"]
    assert list(res.scores("snapkv@4x", "passkey")) == [0.0, 1.0, 0.0]


# -- calibration checkpoint folders ------------------------------------------------------------------------
DIGEST = "0123456789abcdef"


def test_a_checkpoint_folder_is_created_with_its_marker_and_reused_only_by_its_own_run(tmp_path):
    folder = tmp_path / "x.profile.json.partial"
    ckpt = Checkpoint(folder, DIGEST)
    assert folder_digest(folder) == DIGEST
    ckpt.save(0, {"l2": np.ones(3)})
    assert Checkpoint(folder, DIGEST).load(0)["l2"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ProfileError, match="different calibration run"):
        Checkpoint(folder, "fedcba9876543210")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_a_users_folder_at_the_checkpoint_path_is_never_used_or_deleted(tmp_path):
    folder = tmp_path / "x.profile.json.partial"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    with pytest.raises(ProfileError, match="x.profile.json.partial: exists and is not a calibration checkpoint"):
        Checkpoint(folder, DIGEST)
    assert remove_folder(folder) == [] and _tree(tmp_path) == before


def test_a_checkpoint_symlinked_to_a_users_folder_gets_nothing_written_into_it(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    os.symlink(mine, tmp_path / "x.profile.json.partial")
    with pytest.raises(ProfileError, match="a symbolic link"):
        Checkpoint(tmp_path / "x.profile.json.partial", DIGEST)
    remove_folder(tmp_path / "x.profile.json.partial")
    assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


def test_removing_a_finished_checkpoint_keeps_a_file_the_user_put_there(tmp_path):
    folder = tmp_path / "x.profile.json.partial"
    ckpt = Checkpoint(folder, DIGEST)
    ckpt.save(0, {"l2": np.ones(3)})
    (folder / "notes.txt").write_text("mine")
    assert ckpt.remove() == ["notes.txt"]
    assert sorted(os.listdir(folder)) == ["notes.txt", "run.json"]
    (folder / "notes.txt").unlink()
    assert ckpt.remove() == [] and not folder.exists()


@pytest.mark.parametrize("content", [b"", b"not a zip file", b"PK\x03\x04 torn"])
def test_a_damaged_layer_checkpoint_is_named_in_one_line(tmp_path, content):
    folder = tmp_path / "x.profile.json.partial"
    ckpt = Checkpoint(folder, DIGEST)
    (folder / "layer-000.npz").write_bytes(content)
    with pytest.raises(ProfileError, match=r"layer-000.npz: a damaged calibration checkpoint .*delete it to "
                                           r"compute layer 0 again"):
        ckpt.load(0)


def test_a_layer_checkpoint_without_an_array_the_run_needs_is_damaged(tmp_path):
    ckpt = Checkpoint(tmp_path / "p.partial", DIGEST)
    ckpt.save(1, {"l2": np.ones(2)})
    with pytest.raises(ProfileError, match="layer-001.npz: a damaged calibration checkpoint \\(no array 'cosine'\\)"):
        ckpt.load(1, required=("l2", "cosine"))


def test_a_checkpoint_folder_of_an_older_polykv_is_still_resumed(tmp_path):
    folder = tmp_path / "p.partial"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"digest": DIGEST}) + "\n")
    assert Checkpoint(folder, DIGEST).load(0) is None
