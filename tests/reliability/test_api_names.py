"""Names, side files, aliases of a results file and newer results through the Python API: what the CLI table
(cases_names.py) cannot express -- a resume that must still work, two open descriptors, a report that must be
written and stay safe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from cases import plan_dict, profile_dict, spec_dict, write, write_jsonl
from cases_files import header, policy, result

from polykv.cli import main
from polykv.errors import StudyError
from polykv.studies.records import VERSION
from polykv.studies.report import write_report
from polykv.studies.results import Results, ResultsLock, ResultsWriter, read_records
from polykv.studies.runner import prepare
from polykv.studies.spec import load_spec, parse_spec

POLICY = {"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full", "plan": None}
RESULT = {"kind": "result", "policy": "full", "task": "passkey", "item": "passkey-0", "score": 1.0, "kv_bytes": 1000,
          "full_kv_bytes": 1000, "context_tokens": 256}


def _stats_plan(stats: str) -> dict:
    d = plan_dict()
    d["layers"][0]["prefill"] = {"rule": "triattention", "capacity": 64}
    d["model_data"] = {"triattention": stats}
    return d


def _spec_files(tmp_path, *, plan=None, solvers=False, **side: bytes) -> str:
    write(tmp_path, "plan.json", plan or plan_dict())
    write(tmp_path, "prof.json", profile_dict())
    spec = spec_dict()
    if solvers:
        spec.update(profile="prof.json", budgets=["2x"], solvers=[{"name": "mine2", "solver": "exact"}])
    for name, content in side.items():
        write(tmp_path, name.replace("__", "."), content)
    return write(tmp_path, "spec.json", spec)


def _begin(path: str, spec) -> None:
    with ResultsWriter.for_study(path, spec) as w:
        w.append(dict(POLICY))
        w.append(dict(RESULT))


# -- names ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("name", "../../escaped"), ("name", "/abs/x"), ("name", 5), ("name", "a\nb"), ("name", ""), ("name", ".."),
    ("name", "a\\b"), ("name", "a\u2029b"), ("plans", {"../p": "plan.json"}), ("plans", {"a\tb": "plan.json"}),
])
def test_a_name_that_is_no_label_is_refused_naming_the_field(tmp_path, field, value):
    write(tmp_path, "plan.json", plan_dict())
    raw = dict(spec_dict(), **{field: value})
    with pytest.raises(StudyError) as err:
        parse_spec(raw, base=str(tmp_path), source="s.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"s.json: field '{field}'")
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_plain_names_with_spaces_punctuation_and_unicode_are_kept(tmp_path):
    write(tmp_path, "plan.json", plan_dict())
    raw = dict(spec_dict(), name="Étude 3: snap+kivi (v2)", plans={"snap kivi, 8x": "plan.json"})
    spec = parse_spec(raw, base=str(tmp_path), source="s.json")
    assert spec.name == "Étude 3: snap+kivi (v2)" and list(spec.plans) == ["snap kivi, 8x"]


# -- side files -------------------------------------------------------------------------------------------------
def test_the_spec_hash_covers_each_side_file_and_is_unchanged_without_any(tmp_path):
    plain = load_spec(_spec_files(tmp_path / "a"))
    assert plain.side_digests == {} and plain.hash == plain.legacy_hash
    for name in ("prof.qstats.safetensors", "prof.kvbases.safetensors", "prof.kvzip-heads.safetensors"):
        folder = tmp_path / name
        spec = load_spec(_spec_files(folder, solvers=True))
        write(folder, name, b"one")
        one = load_spec(str(folder / "spec.json"))
        write(folder, name, b"two")
        two = load_spec(str(folder / "spec.json"))
        assert spec.hash != one.hash != two.hash and one.legacy_hash == two.legacy_hash == spec.hash
        assert list(two.side_digests) == [str(folder / name)]
    folder = tmp_path / "plan"
    write(folder, "q.bin", b"one")
    one = load_spec(_spec_files(folder, plan=_stats_plan("q.bin")))
    write(folder, "q.bin", b"two")
    assert load_spec(str(folder / "spec.json")).hash != one.hash


def test_a_study_with_unchanged_side_files_resumes(tmp_path):
    spec = load_spec(_spec_files(tmp_path, plan=_stats_plan("q.bin"), q__bin=b"statistics"))
    path = str(tmp_path / "r.jsonl")
    _begin(path, spec)
    again = load_spec(str(tmp_path / "spec.json"))
    assert ResultsWriter.check_study(path, again)[-1]["item"] == "passkey-0"
    with ResultsWriter.for_study(path, again) as w:
        assert ("full", "passkey", "passkey-0") in w.done
    head = read_records(path)[0]
    assert head["version"] == VERSION == 2 and head["files"][str(tmp_path / "q.bin")] == spec.side_digests[
        str(tmp_path / "q.bin")]


def test_a_changed_side_file_is_refused_by_check_and_open_and_the_file_is_left_as_it_was(tmp_path):
    spec = load_spec(_spec_files(tmp_path, plan=_stats_plan("q.bin"), q__bin=b"statistics"))
    path = str(tmp_path / "r.jsonl")
    _begin(path, spec)
    before = open(path, "rb").read()
    write(tmp_path, "q.bin", b"recomputed statistics")
    changed = load_spec(str(tmp_path / "spec.json"))
    for call in (lambda: ResultsWriter.check_study(path, changed), lambda: ResultsWriter.for_study(path, changed)):
        with pytest.raises(StudyError, match=re.escape(f"{tmp_path / 'q.bin'} changed since it was begun")):
            call()
    assert open(path, "rb").read() == before


def test_a_version_1_results_file_resumes_with_a_warning_that_its_side_files_are_unchecked(tmp_path):
    spec = load_spec(_spec_files(tmp_path, solvers=True, prof__qstats__safetensors=b"statistics"))
    path = str(tmp_path / "r.jsonl")
    old = {"format": "polykv-study-results", "kind": "header", "version": 1, "spec_hash": spec.legacy_hash,
           "spec": spec.as_dict()}
    write_jsonl(tmp_path, "r.jsonl", [old, POLICY, RESULT])
    prepared = prepare(spec, path)
    notes = [n for n in prepared.warnings if "side files" in n]
    assert len(notes) == 1 and "prof.qstats.safetensors" in notes[0]
    with ResultsWriter.for_study(path, spec) as w:
        assert len(w.done) == 1
    assert read_records(path)[0] == json.loads(json.dumps(old))  # the header stays the one it was begun with


# -- two runs on one results file -----------------------------------------------------------------------------
def test_a_hard_link_of_a_held_results_file_is_refused_until_the_holder_closes(tmp_path):
    spec = load_spec(_spec_files(tmp_path))
    path, alias = str(tmp_path / "r.jsonl"), str(tmp_path / "alias.jsonl")
    holder = ResultsWriter.for_study(path, spec)
    os.link(path, alias)
    try:
        for call in (lambda: ResultsWriter.check_study(alias, spec), lambda: ResultsWriter.for_study(alias, spec),
                     lambda: ResultsLock.acquire(alias)):
            with pytest.raises(StudyError, match=re.escape(f"{alias}: another polykv run holds this results file")):
                call()
    finally:
        holder.close()
    with ResultsWriter.for_study(alias, spec) as w:
        w.append(dict(POLICY))
    assert [r["kind"] for r in read_records(path)] == ["header", "policy"]


def test_a_lock_that_created_the_results_file_removes_it_when_nothing_was_written(tmp_path):
    path = str(tmp_path / "r.jsonl")
    ResultsLock.acquire(path).release()
    assert not os.path.exists(path)
    ResultsLock.probe(path)  # holds nothing afterwards
    ResultsLock.acquire(path).release()


@pytest.mark.slow
def test_a_hard_link_is_refused_while_another_process_writes_the_file(tmp_path):
    spec_path = _spec_files(tmp_path)
    path, alias = str(tmp_path / "r.jsonl"), str(tmp_path / "alias.jsonl")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from polykv.studies.results import ResultsWriter
        from polykv.studies.spec import load_spec
        w = ResultsWriter.for_study({path!r}, load_spec({spec_path!r}))
        print("locked", flush=True)
        sys.stdin.readline()
        w.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        os.link(path, alias)
        with pytest.raises(StudyError, match="another polykv run holds this results file"):
            ResultsWriter.for_study(alias, load_spec(spec_path))
    finally:
        holder.communicate("go\n", timeout=120)
    assert holder.returncode == 0
    ResultsWriter.for_study(alias, load_spec(spec_path)).close()


# -- results from a newer polykv --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [VERSION + 1, 99])
def test_a_newer_results_file_is_called_newer_not_damaged(tmp_path, version):
    path = write_jsonl(tmp_path, "r.jsonl", [header(version=version, colour="a field of the future"), policy()])
    with pytest.raises(StudyError) as err:
        Results.load(path)
    msg = str(err.value)
    assert f"written by a newer polykv (results format version {version}; this polykv reads up to version " \
           f"{VERSION})" in msg and "damaged" not in msg and "upgrade polykv" in msg


@pytest.mark.parametrize("version", range(1, VERSION + 1))
def test_every_version_this_polykv_wrote_reads(tmp_path, version):
    path = write_jsonl(tmp_path, "r.jsonl", [header(version=version), policy(), result()])
    assert len(Results.load(path).results) == 1


# -- names in the report ----------------------------------------------------------------------------------------
NASTY = "a|b\n<img src=x onerror=alert(1)>`$\\frac$_*[x](y)"


def _tables(md: str) -> list[list[str]]:
    tables, current = [], []
    for ln in md.splitlines() + [""]:
        if ln.startswith("|"):
            current.append(ln)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_a_report_prints_hostile_names_as_text(tmp_path):
    lines = [header(spec={"name": "s|<b>x</b>\n# h", "context_tokens": 256, "model": "<script>", "dtype": "x|y"}),
             policy(), policy(NASTY + "@4x", method=NASTY, budget="4x|<i>", role="", plan=plan_dict()),
             policy("b$x$@4x", method="$\\frac$", budget="4x|<i>", role="", plan=plan_dict())]
    for i in range(3):
        lines.append(result(i, task="pk|<u>\n"))
        lines.append(result(i, NASTY + "@4x", task="pk|<u>\n", score=float(i % 2), kv_bytes=250))
        lines.append(result(i, "b$x$@4x", task="pk|<u>\n", score=1.0, kv_bytes=260))
    path = write_jsonl(tmp_path, "r.jsonl", lines)
    assert main(["report", path, "-o", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "<img" not in md and "<b>" not in md.replace("`s|<b>x</b>\\n# h`", "") and "<i>" not in md
    assert md.startswith("# Study `s|<b>x</b>\\n# h`\n")  # a code span: shown literally, one line
    assert "## Task `pk|<u>\\n` (3 paired items)" in md
    for table in _tables(md):  # every row of a table has as many cells as its header
        assert len({len(re.findall(r"(?<!\\)\|", row)) for row in table}) == 1, table
    assert "| a\\|b\\\\n&lt;img src=x onerror=alert(1)&gt;\\`\\$\\\\frac\\$\\_\\*\\[x\\](y)@4x |" in md
    assert sorted(os.listdir(tmp_path / "rep")) == ["pk_u_-score-vs-memory.png", "report.md", "routes-4x_i_.png"]


def test_report_md_of_plain_names_is_unchanged_by_escaping(tmp_path):
    lines = [header(), policy(), policy("2d_hetero@4x", method="2d_hetero", budget="4x", role="2d_hetero")]
    for i in range(2):
        lines += [result(i), result(i, "2d_hetero@4x", kv_bytes=250)]
    md_path = write_report(write_jsonl(tmp_path, "r.jsonl", lines), str(tmp_path / "rep"))[0]
    md = open(md_path).read()
    assert "| 2d_hetero@4x | 4x | 2d_hetero |" in md and md.startswith("# Study `x`\n")
