"""Bad-input cases for the user's own JSONL data (``jsonl_file``), the options every file task shares
(``max_new_tokens``, ``stop``, ``question_template``, ``metric``), the offline RULER tasks' parameters and the
CSV export of ``polykv report --csv``.

Each names what to fix: the file and line and field of a bad line, ``params.<name>`` of a bad option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cases import _file_study, _study, add, longbench_line, ruler_line, spec_dict, write, write_jsonl


def user_line(i: int, **kw) -> dict[str, Any]:
    rec = {"context": f"Note {i}. The meeting moved to room {100 + i}.", "question": f"Which room for note {i}?",
           "answers": [f"room {100 + i}"]}
    rec.update(kw)
    return rec


def _drop(rec: dict, key: str) -> dict:
    return {k: v for k, v in rec.items() if k != key}


def _jsonl(d: Path, lines: list[Any], **params) -> list[str]:
    return _file_study(d, "jsonl_file", lines, **params)


OK = [user_line(0), user_line(1)]
JSONL_BAD = [
    # id, lines, params, what the error names
    ("missing-answers", [user_line(0), _drop(user_line(1), "answers")], {}, "line 2"),
    ("missing-context", [_drop(user_line(0), "context"), user_line(1)], {}, "'context'"),
    ("answers-number", [user_line(0, answers=5), user_line(1)], {}, "'answers'"),
    ("answers-empty-list", [user_line(0, answers=[]), user_line(1)], {}, "'answers'"),
    ("answers-empty-string", [user_line(0, answers=""), user_line(1)], {}, "'answers'"),
    ("answers-dicts", [user_line(0, answers=[{"text": "x"}]), user_line(1)], {}, "'answers'"),
    ("context-empty", [user_line(0, context="  "), user_line(1)], {}, "'context'"),
    ("question-int", [user_line(0, question=3), user_line(1)], {}, "'question'"),
    ("not-json", [user_line(0), "{oops"], {}, "line 2"),
    ("not-object", [user_line(0), "[1]"], {}, "line 2"),
    ("renamed-field-missing", OK, {"question_field": "query"}, "'query'"),
    ("id-field-missing", OK, {"id_field": "uid"}, "'uid'"),
    ("id-duplicate", [user_line(0, uid="a"), user_line(1, uid="a")], {"id_field": "uid"}, "'uid'"),
    ("metric-unknown", OK, {"metric": "bleu"}, "params.metric"),
    ("metric-classification", OK, {"metric": "classification"}, "params.metric"),
    ("max-new-0", OK, {"max_new_tokens": 0}, "params.max_new_tokens"),
    ("stop-string", OK, {"stop": "\n"}, "params.stop"),
    ("stop-empty-entry", OK, {"stop": [""]}, "params.stop"),
    ("template-no-placeholder", OK, {"question_template": "Answer:"}, "params.question_template"),
    ("template-bad-brace", OK, {"question_template": "Q: {question"}, "params.question_template"),
    ("template-other-field", OK, {"question_template": "Q: {input}"}, "params.question_template"),
    ("too-few", [user_line(0)], {}, "items"),
]
for _id, _lines, _params, _expect in JSONL_BAD:
    add(f"taskfile-jsonl-{_id}", "taskfile", lambda d, ls=_lines, p=_params: _jsonl(d, ls, **p), _expect,
        ("r.jsonl",))
add("taskfile-jsonl-empty-file", "taskfile", lambda d: _file_study(d, "jsonl_file", [], raw=b"\n\n"),
    "items.jsonl", ("r.jsonl",))

# The options every file task shares, on LongBench and RULER files.
LB = [longbench_line(0), longbench_line(1)]
RL = [ruler_line(0), ruler_line(1)]
SHARED_BAD = [
    ("longbench", LB, "metric-unknown", {"metric": "bleu"}, "params.metric"),
    ("longbench", LB, "metric-fidelity", {"metric": "fidelity"}, "params.metric"),
    ("longbench", LB, "max-new-0", {"max_new_tokens": 0}, "params.max_new_tokens"),
    ("longbench", LB, "stop-string", {"stop": "\n"}, "params.stop"),
    ("longbench", LB, "template-bad-brace", {"question_template": "Q: {input"}, "params.question_template"),
    ("longbench", LB, "template-other-field", {"question_template": "Q: {question}"}, "params.question_template"),
    ("longbench", [user_line(0), user_line(1)], "user-file", {}, "jsonl_file"),
    ("ruler", RL, "metric-unknown", {"metric": "bleu"}, "params.metric"),
    ("ruler", RL, "stop-empty-entry", {"stop": [""]}, "params.stop"),
]
for _fmt, _lines, _id, _params, _expect in SHARED_BAD:
    add(f"taskfile-{_fmt}-shared-{_id}", "taskfile",
        lambda d, f=_fmt, ls=_lines, p=_params: _file_study(d, f"{f}_file", ls, **p), _expect, ("r.jsonl",))


# The offline RULER tasks' parameters (checked when the spec is read, before any model loads).
def _synthetic(d: Path, task: str, **params) -> list[str]:
    spec = spec_dict()
    spec["tasks"] = [{"task": task, "params": params, "samples": 1, "seed": 0}]
    return _study(d, spec)


SYNTH_BAD = [
    ("niah_multiquery", "queries-over-keys", {"num_keys": 2, "num_queries": 4}, "params.num_queries"),
    ("cwe", "num-cw-0", {"num_cw": 0}, "num_cw"),
    ("cwe", "freq-cw-not-above-ucw", {"freq_cw": 3, "freq_ucw": 3}, "freq_cw"),
    ("cwe", "length-text", {"length": "4k"}, "length"),
    ("fwe", "alpha-1", {"alpha": 1.0}, "alpha"),
    ("fwe", "alpha-nan", {"alpha": "nan"}, "alpha"),
    ("fwe", "unknown-param", {"num_words": 5}, "num_words"),
    ("fwe", "length-under-5-words", {"length": 200}, "params.length"),
    ("fwe", "vocab-size-4", {"vocab_size": 4}, "vocab_size"),
]
for _task, _id, _params, _expect in SYNTH_BAD:
    add(f"task-{_task}-{_id}", "spec", lambda d, t=_task, p=_params: _synthetic(d, t, **p), _expect, ("r.jsonl",))


# `polykv report --csv`: the CSV files are outputs like report.md.
def _results(d: Path) -> str:
    return write_jsonl(d, "r.jsonl", [
        {"format": "polykv-study-results", "kind": "header", "spec": {"name": "x", "context_tokens": 256},
         "spec_hash": "spec-0", "version": 1},
        {"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full", "plan": None},
        {"kind": "result", "policy": "full", "task": "passkey", "item": "passkey-0", "score": 1.0, "kv_bytes": 1000,
         "full_kv_bytes": 1000, "context_tokens": 256}])


def _report_csv_over(d: Path, name: str, content: Any) -> list[str]:
    results = _results(d)
    (d / "out").mkdir()
    if content is None:
        (d / "out" / name).mkdir()
    else:
        write(d, f"out/{name}", content)
    return ["report", results, "-o", str(d / "out"), "--csv"]


add("report-csv-policies-is-folder", "cli", lambda d: _report_csv_over(d, "policies.csv", None), "policies.csv",
    ("out/report.md", "out/items.csv"))
add("report-csv-items-user-file", "cli", lambda d: _report_csv_over(d, "items.csv", "my,own,sheet\n1,2,3\n"),
    "items.csv", ("out/report.md", "out/policies.csv"))
add("report-csv-policies-user-file", "cli", lambda d: _report_csv_over(d, "policies.csv", "name\nmine\n"),
    "policies.csv", ("out/report.md", "out/items.csv"))
