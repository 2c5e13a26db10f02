"""Bad-input cases about files polykv did not create and results files that are not what polykv writes.

- ``results``: malformed results files, read by ``polykv report`` and by a resuming ``polykv study``
  (every complete line is checked: type and range of every field, one header, each record once).
- ``files``: lock files, report figures and calibration checkpoint folders that are not polykv's own
  (a user's file, a symlink, a FIFO, a folder): refused in one line and left byte-identical (the
  harness classifies any change to an existing file as data loss).
- ``cli``: ``--threads`` past the machine, a missing ``--profile``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cases import _HELD, _study, add, model_folder, plan_dict, profile_dict, spec_dict, write, write_jsonl

FORMAT = "polykv-study-results"


def header(spec_hash: str = "spec-0", **over) -> dict[str, Any]:
    rec = {"format": FORMAT, "kind": "header", "spec": {"name": "x", "context_tokens": 256}, "spec_hash": spec_hash,
           "version": 1}
    rec.update(over)
    return rec


def policy(name: str = "full", **over) -> dict[str, Any]:
    rec = {"kind": "policy", "policy": name, "method": name.split("@")[0], "budget": None, "role": "full",
           "plan": None}
    rec.update(over)
    return rec


def result(item: int = 0, name: str = "full", **over) -> dict[str, Any]:
    rec = {"kind": "result", "policy": name, "task": "passkey", "item": f"passkey-{item}", "score": 1.0,
           "kv_bytes": 1000, "full_kv_bytes": 1000, "context_tokens": 256}
    rec.update(over)
    return rec


def _drop(rec: dict, key: str) -> dict:
    return {k: v for k, v in rec.items() if k != key}


FORCED = {"kl": 0.1, "kl_max": 0.5, "top1": 0.9, "ppl": 3.0, "ppl_full": 2.9, "positions": 7}

# (id, the lines after the header (None: the header itself replaced), what the error names)
BAD_LINES: list[tuple[str, list[Any], str]] = [
    ("line-int", [policy(), "5", result()], "line 3"),
    ("line-list", [policy(), "[1,2]", result()], "line 3"),
    ("line-null", [policy(), "null", result()], "line 3"),
    ("line-string", [policy(), '"result"', result()], "line 3"),
    ("line-empty", [policy(), "", result()], "line 3"),
    ("line-torn-middle", [policy(), '{"kind": "result", "policy": "fu', result()], "line 3"),
    ("line-nan-score", [policy(), json.dumps(result()).replace('"score": 1.0', '"score": NaN')], "line 3"),
    ("line-duplicate-key", [policy(), json.dumps(result())[:-1] + ', "score": 0.0}'], "line 3"),
    ("result-bare", [policy(), {"kind": "result"}], "line 3, field 'policy'"),
    ("result-no-kv-bytes", [policy(), _drop(result(), "kv_bytes")], "line 3, field 'kv_bytes'"),
    ("result-no-score", [policy(), _drop(result(), "score")], "line 3, field 'score'"),
    ("result-no-context", [policy(), _drop(result(), "context_tokens")], "line 3, field 'context_tokens'"),
    ("score-7.5", [policy(), result(score=7.5)], "line 3, field 'score'"),
    ("score-negative", [policy(), result(score=-0.5)], "line 3, field 'score'"),
    ("score-high", [policy(), result(score="high")], "line 3, field 'score'"),
    ("score-bool", [policy(), result(score=True)], "line 3, field 'score'"),
    ("score-null", [policy(), result(score=None)], "line 3, field 'score'"),
    ("kv-bytes-negative", [policy(), result(kv_bytes=-1)], "line 3, field 'kv_bytes'"),
    ("kv-bytes-float", [policy(), result(kv_bytes=1.5)], "line 3, field 'kv_bytes'"),
    ("kv-bytes-text", [policy(), result(kv_bytes="1000")], "line 3, field 'kv_bytes'"),
    ("context-0", [policy(), result(context_tokens=0)], "line 3, field 'context_tokens'"),
    ("metadata-negative", [policy(), result(metadata_bytes=-3)], "line 3, field 'metadata_bytes'"),
    ("per-layer-text", [policy(), result(kv_bytes_per_layer=[1, "x"])], "line 3, field 'kv_bytes_per_layer'"),
    ("seconds-negative", [policy(), result(seconds=-1.0)], "line 3, field 'seconds'"),
    ("task-empty", [policy(), result(task="")], "line 3, field 'task'"),
    ("item-int", [policy(), dict(result(), item=3)], "line 3, field 'item'"),
    ("meta-nested", [policy(), result(meta={"a": [1]})], "line 3, field 'meta'"),
    ("bos-first-text", [policy(), result(bos_first="yes")], "line 3, field 'bos_first'"),
    ("unknown-field", [policy(), result(scor=1.0)], "line 3, field 'scor'"),
    ("kind-unknown", [policy(), result(kind="resul")], "line 3, field 'kind'"),
    ("kind-missing", [policy(), _drop(result(), "kind")], "line 3, field 'kind'"),
    ("forced-kl-negative", [policy(), result(**dict(FORCED, kl=-1.0))], "line 3, field 'kl'"),
    ("forced-ppl-0", [policy(), result(**dict(FORCED, ppl=0.0))], "line 3, field 'ppl'"),
    ("forced-top1-above", [policy(), result(**dict(FORCED, top1=1.5))], "line 3, field 'top1'"),
    ("forced-partial", [policy(), result(kl=0.1)], "line 3, field 'kl_max'"),
    ("duplicate-conflicting", [policy(), result(score=1.0), result(score=0.0)], "line 4, field 'item'"),
    ("duplicate-same", [policy(), result(), result()], "line 4, field 'item'"),
    ("result-unknown-policy", [policy(), result(name="ghost")], "line 3, field 'policy'"),
    ("policy-twice", [policy(), policy()], "line 3, field 'policy'"),
    ("policy-nameless", [_drop(policy(), "policy")], "line 2, field 'policy'"),
    ("policy-nominal-negative", [policy(nominal_bytes=-5)], "line 2, field 'nominal_bytes'"),
    ("policy-plan-list", [policy(plan=[1])], "line 2, field 'plan'"),
    ("policy-budget-int", [policy(budget=8)], "line 2, field 'budget'"),
    ("two-headers", [policy(), header(), result()], "line 3, field 'kind'"),
    ("header-no-spec", None, "line 1, field 'spec'"),
    ("header-version-99", None, "line 1, field 'version'"),
    ("header-version-float", None, "line 1, field 'version'"),
    ("header-spec-list", None, "line 1, field 'spec'"),
    ("header-hash-int", None, "line 1, field 'spec_hash'"),
    ("header-unknown-field", None, "line 1, field 'colour'"),
    ("header-context-text", None, "line 1, field 'spec.context_tokens'"),
    ("header-bos-maybe", None, "line 1, field 'spec.bos'"),
]
HEADERS = {
    "header-no-spec": _drop(header(), "spec"),
    "header-version-99": header(version=99),
    "header-version-float": header(version=1.0),
    "header-spec-list": header(spec=[1]),
    "header-hash-int": header(spec_hash=7),
    "header-unknown-field": header(colour="red"),
    "header-context-text": header(spec={"name": "x", "context_tokens": "256"}),
    "header-bos-maybe": header(spec={"name": "x", "bos": "maybe"}),
}


def _lines(cid: str, spec_hash: str) -> list[Any]:
    body = dict((c[0], c[1]) for c in BAD_LINES)[cid]
    if body is None:
        return [dict(HEADERS[cid], **({"spec_hash": spec_hash} if "spec_hash" in HEADERS[cid] and
                                      cid != "header-hash-int" else {})), policy(), result()]
    return [header(spec_hash)] + body


def _spec_hash(d: Path) -> str:
    from polykv.studies.spec import load_spec

    return load_spec(str(d / "spec.json")).hash


def _report_case(cid: str):
    def setup(d: Path) -> list[str]:
        return ["report", write_jsonl(d, "r.jsonl", _lines(cid, "spec-0")), "-o", str(d / "rep")]
    return setup


def _resume_case(cid: str):
    def setup(d: Path) -> list[str]:
        argv = _study(d, spec_dict())
        write_jsonl(d, "r.jsonl", _lines(cid, _spec_hash(d)))
        return argv
    return setup


for _id, _body, _expect in BAD_LINES:
    add(f"results-report-{_id}", "results", _report_case(_id), f"r.jsonl {_expect}", ("rep",))
    add(f"results-resume-{_id}", "results", _resume_case(_id), f"r.jsonl {_expect}")

add("results-first-line-result", "results", lambda d: ["report", write_jsonl(d, "r.jsonl", [result()]), "-o",
                                                       str(d / "rep")], "not a polykv study results file", ("rep",))
add("results-not-utf8", "results", lambda d: ["report", write(
    d, "r.jsonl", (json.dumps(header()) + "\n" + json.dumps(policy()) + "\n").encode() + b'{"kind": "\xff"}\n'),
    "-o", str(d / "rep")], "r.jsonl line 3", ("rep",))


# -- report figures and task names ---------------------------------------------------------------------------
def good_results(d: Path, *, task: str = "passkey", plan: bool = False) -> str:
    """A small valid results file: full + one budgeted policy (optionally with its plan) x 3 items."""
    lines: list[Any] = [header(), policy()]
    lines.append(policy("snapkv@4x", budget="4x", role="", plan=plan_dict() if plan else None))
    for i in range(3):
        lines.append(result(i, task=task))
        lines.append(result(i, "snapkv@4x", task=task, score=float(i % 2), kv_bytes=250))
    return write_jsonl(d, "r.jsonl", lines)


THESIS = b"\x89PNG\r\n\x1a\n my own figure, not polykv's"


def _foreign_figure(name: str, *extra: str, plan: bool = False):
    def setup(d: Path) -> list[str]:
        write(d, f"figs/{name}", THESIS)
        argv = ["report", good_results(d, plan=plan), "-o", str(d / "figs")]
        if extra:
            argv += ["--profile", write(d, "prof.json", profile_dict())]
        return argv
    return setup


add("files-report-foreign-score-figure", "files", _foreign_figure("passkey-score-vs-memory.png"),
    "passkey-score-vs-memory.png", ("figs/report.md",))
add("files-report-foreign-routes-figure", "files", _foreign_figure("routes-4x.png", plan=True), "routes-4x.png",
    ("figs/report.md", "figs/passkey-score-vs-memory.png"))
add("files-report-foreign-sensitivity", "files", _foreign_figure("sensitivity.png", "--profile"), "sensitivity.png",
    ("figs/report.md", "figs/passkey-score-vs-memory.png"))
add("files-report-figure-symlink-to-user-file", "files", lambda d: (
    write(d, "thesis.png", THESIS), os.makedirs(d / "figs"),
    os.symlink(d / "thesis.png", d / "figs" / "passkey-score-vs-memory.png"),
    ["report", good_results(d), "-o", str(d / "figs")])[-1], "passkey-score-vs-memory.png", ("figs/report.md",))
add("files-report-figure-is-folder", "files", lambda d: (
    os.makedirs(d / "figs" / "passkey-score-vs-memory.png"),
    ["report", good_results(d), "-o", str(d / "figs")])[-1], "passkey-score-vs-memory.png", ("figs/report.md",))
add("files-report-escaped-task-foreign", "files", lambda d: (
    write(d, "figs/escaped-score-vs-memory.png", THESIS),
    ["report", good_results(d, task="../../escaped"), "-o", str(d / "figs")])[-1], "escaped-score-vs-memory.png",
    ("figs/report.md",))
add("cli-report-profile-missing", "cli", lambda d: ["report", good_results(d), "-o", str(d / "rep"), "--profile",
                                                     str(d / "nonexistent.json")], "--profile", ("rep",))
add("cli-report-profile-folder", "cli", lambda d: ["report", good_results(d), "-o", str(d / "rep"), "--profile",
                                                    str(d)], "--profile", ("rep",))


# -- results lock files --------------------------------------------------------------------------------------
def _lock_case(make):
    def setup(d: Path) -> list[str]:
        argv = _study(d, spec_dict())
        make(d)
        return argv
    return setup


add("files-lock-user-file", "files", _lock_case(lambda d: write(d, "r.jsonl.lock", "my notes\n")), "r.jsonl.lock",
    ("r.jsonl",))
add("files-lock-empty-file", "files", _lock_case(lambda d: write(d, "r.jsonl.lock", "")), "r.jsonl.lock",
    ("r.jsonl",))
add("files-lock-symlink-to-thesis", "files", _lock_case(lambda d: (
    write(d, "thesis.txt", "chapter one\n"), os.symlink(d / "thesis.txt", d / "r.jsonl.lock"))), "r.jsonl.lock",
    ("r.jsonl",))
add("files-lock-dangling-symlink", "files", _lock_case(lambda d: os.symlink(d / "gone", d / "r.jsonl.lock")),
    "r.jsonl.lock", ("r.jsonl", "gone"))
add("files-lock-fifo", "files", _lock_case(lambda d: os.mkfifo(d / "r.jsonl.lock")), "r.jsonl.lock", ("r.jsonl",))
add("files-lock-folder", "files", _lock_case(lambda d: os.mkdir(d / "r.jsonl.lock")), "r.jsonl.lock", ("r.jsonl",))


def _locked_through_symlink(d: Path) -> list[str]:
    """Another study holds r.jsonl; this one names a symlink to it: the same results file, the same lock."""
    from polykv.studies.results import ResultsLock

    argv = _study(d, spec_dict())
    write(d, "r.jsonl", "")
    os.symlink(d / "r.jsonl", d / "link.jsonl")
    _HELD.append(ResultsLock.acquire(str(d / "r.jsonl")))
    return argv[:-1] + [str(d / "link.jsonl")]


add("files-lock-held-through-symlink", "files", _locked_through_symlink, "another polykv study is writing")


# -- calibration checkpoint folders --------------------------------------------------------------------------
def _calibrate(d: Path, *extra: str) -> list[str]:
    return ["calibrate", model_folder(d), "-o", "x.profile.json", *extra]


def _partial_case(make):
    def setup(d: Path) -> list[str]:
        argv = _calibrate(d)
        make(d)
        return argv
    return setup


PARTIAL = "x.profile.json.partial"
add("files-partial-user-folder", "files", _partial_case(lambda d: write(d, f"{PARTIAL}/notes.txt", "mine\n")),
    PARTIAL, ("x.profile.json",))
add("files-partial-empty-folder", "files", _partial_case(lambda d: os.mkdir(d / PARTIAL)), PARTIAL,
    ("x.profile.json",))
add("files-partial-symlink-to-user-folder", "files", _partial_case(lambda d: (
    write(d, "mine/notes.txt", "mine\n"), os.symlink(d / "mine", d / PARTIAL))), PARTIAL, ("x.profile.json",))
add("files-partial-symlink-to-own-checkpoint", "files", _partial_case(lambda d: (
    write(d, "elsewhere/run.json", {"format": "polykv-calibration-checkpoint", "digest": "0123456789abcdef"}),
    os.symlink(d / "elsewhere", d / PARTIAL))), PARTIAL, ("x.profile.json",))
add("files-partial-run-json-corrupt", "files", _partial_case(lambda d: write(d, f"{PARTIAL}/run.json", "{\n")),
    "run.json", ("x.profile.json",))
add("files-partial-run-json-empty", "files", _partial_case(lambda d: write(d, f"{PARTIAL}/run.json", "")),
    "run.json", ("x.profile.json",))
add("files-partial-run-json-foreign", "files", _partial_case(lambda d: write(d, f"{PARTIAL}/run.json",
                                                                            {"name": "my run"})), "run.json",
    ("x.profile.json",))
add("files-partial-run-json-folder", "files", _partial_case(lambda d: os.makedirs(d / PARTIAL / "run.json")),
    "run.json", ("x.profile.json",))
add("files-partial-fifo", "files", _partial_case(lambda d: os.mkfifo(d / PARTIAL)), PARTIAL, ("x.profile.json",))


# -- --threads past the machine ------------------------------------------------------------------------------
for _n in ("100000", "-3"):
    add(f"cli-study-threads-{_n}", "cli", lambda d, n=_n: _study(d, spec_dict())[:2] + [
        "--results", str(d / "r.jsonl"), "--threads", n], "--threads", ("r.jsonl",))
    add(f"cli-calibrate-threads-{_n}", "cli", lambda d, n=_n: _calibrate(d, "--threads", n), "--threads",
        ("x.profile.json",))
