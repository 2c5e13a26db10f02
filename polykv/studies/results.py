"""Study results: one JSONL file per study, appended one durable line at a time.

Line 1 is the header ``{"kind": "header", "spec_hash": ..., "spec": {...}}``. Then, in the order they
finish, ``{"kind": "policy", ...}`` records (one per policy: its plan, nominal bytes, budget, role) and
``{"kind": "result", ...}`` records (one per (policy, task, item): score, measured resident KV bytes,
the generated text). Every line is written with :func:`polykv.atomic.append_line_durable` (fsync),
so a crash loses at most the line being written; :meth:`ResultsWriter.open` drops such a torn last
line and a resumed study skips every (policy, task, item) already recorded.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

import attrs
import numpy as np

from polykv.atomic import append_line_durable
from polykv.errors import OutputError, StudyError
from polykv.strict_json import JsonInputError, check_readable_file, loads_strict
from polykv.studies.records import FORMAT, VERSION, BadField, NewerVersion, RecordChecker
from polykv.studies.results_lock import ResultsLock


if TYPE_CHECKING:
    from polykv.studies.spec import StudySpec

HEADER_PREFIX = b'{"format": "polykv-study-results"'
"""How polykv writes every header (sorted keys, so ``format`` comes first): how a torn header is recognised."""


def _read_bytes(path: str) -> bytes:
    try:
        check_readable_file(path, "results file")
        with open(path, "rb") as fh:
            return fh.read()
    except OutputError as exc:
        raise StudyError(str(exc)) from None


def _is_header(line: bytes) -> bool:
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and rec.get("kind") == "header" and rec.get("format") == FORMAT


def _recognised(data: bytes) -> bool:
    """Empty, a complete header line first, or a header torn while polykv was writing it."""
    if not data:
        return True
    first, newline, _ = data.partition(b"\n")
    if newline:
        return _is_header(first)
    return HEADER_PREFIX.startswith(first[:len(HEADER_PREFIX)]) or _is_header(first)


def _not_ours(path: str) -> StudyError:
    return StudyError(f"{path}: not a polykv study results file (its first line is not a '{FORMAT}' header); "
                      "polykv will not change or delete it. Pass another results path")


def _damaged(path: str, line: int, problem: str, field: str | None = None) -> StudyError:
    where = f"{path} line {line}" + (f", field '{field}'" if field else "")
    return StudyError(f"{where}: {problem}; the results file is damaged (fix or remove that line, or start a new "
                      "results file)")


def _read_lines(path: str) -> tuple[list[dict], int | None]:
    """Checked records, and the byte offset of a torn last line (None when the file ends cleanly).

    Every complete line must be a valid record (:mod:`polykv.studies.records`); only the last line,
    when it lacks its newline (the process stopped while writing it), is left out instead.
    """
    records, offset = [], 0
    data = _read_bytes(path)
    if not _recognised(data):
        raise _not_ours(path)
    checker = RecordChecker()
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if i == len(lines) - 1:  # after the last newline: empty, or a line torn by a killed process
            return records, (offset if line else None)
        try:
            rec = loads_strict(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise _damaged(path, i + 1, f"not UTF-8 text (byte {exc.start})") from None
        except JsonInputError as exc:
            problem = "an empty line" if not line.strip() else f"not a JSON record ({exc.message}, column " \
                                                              f"{exc.column})"
            raise _damaged(path, i + 1, problem) from None
        try:
            records.append(checker.check(rec, i + 1))
        except NewerVersion as exc:  # not damaged: this polykv is too old for it
            raise StudyError(f"{path} line {i + 1}, field 'version': {exc.problem}; upgrade polykv to read or "
                             "resume it, or pass another results file") from None
        except BadField as exc:
            raise _damaged(path, i + 1, exc.problem, exc.field) from None
        offset += len(line) + 1
    return records, None


def is_results_file(path: str) -> bool:
    """True when ``path`` is a results file (or empty, or a torn header): a file ``polykv study`` may extend."""
    with open(path, "rb") as fh:
        first = fh.readline(1 << 26)
    return _recognised(first)


def read_records(path: str) -> list[dict]:
    """All complete records of a results file (header first); a torn last line is ignored."""
    if not os.path.exists(path):
        raise StudyError(f"{path}: no such results file")
    records, _ = _read_lines(path)
    if not records or records[0].get("kind") != "header" or records[0].get("format") != FORMAT:
        raise StudyError(f"{path}: not a polykv study results file (its first line is not a "
                         f"'{FORMAT}' header)")
    return records


class ResultsWriter:
    """Append-only results of one study; refuses a file written by another study.

    The writer holds an advisory lock (``fcntl.flock``) on ``<results>.lock`` and on the results file itself
    from :meth:`open` to :meth:`close` (:class:`~polykv.studies.results_lock.ResultsLock`), so a second writer of
    the same file, by any of its names, is refused.
    """

    def __init__(self, path: str, spec_hash: str, records: list[dict], lock: "ResultsLock | None" = None):
        self.path, self.spec_hash, self.lock = path, spec_hash, lock
        self.done: set[tuple[str, str, str]] = {(r["policy"], r["task"], r["item"]) for r in records
                                                if r.get("kind") == "result"}
        self.policies: dict[str, dict] = {r["policy"]: r for r in records if r.get("kind") == "policy"}
        self._checker = RecordChecker()
        for i, rec in enumerate(records):
            self._checker.check(rec, i + 1)

    @classmethod
    def check(cls, path: str, spec_hash: str, *, files: dict[str, str] | None = None,
              legacy_hash: str | None = None) -> list[dict]:
        """Records of an existing file of this study ([] when there is none); else a StudyError.

        Refuses a file that is not a results file (never deleting it), a damaged one, one of another
        study, and one another process is writing right now. ``files`` (path -> sha256 of every file the
        study reads) names the file that changed when the header recorded other contents; a header without
        them (format version 1) resumes under ``legacy_hash``, the hash of that version.
        """
        ResultsLock.probe(path)
        return cls._existing(path, spec_hash, files, legacy_hash)[0]

    @classmethod
    def check_study(cls, path: str, spec: "StudySpec") -> list[dict]:
        """:meth:`check` for the study ``spec``."""
        return cls.check(path, spec.hash, files=spec.files, legacy_hash=spec.legacy_hash)

    @classmethod
    def for_study(cls, path: str, spec: "StudySpec") -> "ResultsWriter":
        """:meth:`open` for the study ``spec``: its hash, its spec and the sha256 of every file it reads."""
        return cls.open(path, spec.hash, spec.as_dict(), files=spec.files, legacy_hash=spec.legacy_hash)

    @staticmethod
    def _existing(path: str, spec_hash: str, files: dict[str, str] | None = None,
                  legacy_hash: str | None = None) -> tuple[list[dict], int | None]:
        """(records of this study, offset of a torn last line); ([], None) when the file may start afresh."""
        if os.path.isdir(path):
            raise StudyError(f"{path}: is a folder; --results names the results file (JSONL) to write")
        if not os.path.exists(path):
            return [], None
        try:
            records, torn = _read_lines(path)
        except StudyError:
            header = _header_of(path)
            if header is not None and not _resumes(header, spec_hash, legacy_hash):  # not ours to check or resume
                raise _other_study(path, header, spec_hash, files) from None
            raise
        if not records:
            return [], None  # an empty file, or only a torn header: start afresh
        if not _resumes(records[0], spec_hash, legacy_hash):
            if not any(r["kind"] == "result" for r in records):
                return [], None  # a run refused before its first result (the spec was fixed since): nothing to lose
            raise _other_study(path, records[0], spec_hash, files)
        return records, torn

    @classmethod
    def open(cls, path: str, spec_hash: str, spec: dict[str, Any], *, files: dict[str, str] | None = None,
             legacy_hash: str | None = None) -> "ResultsWriter":
        """Lock the file, then create it with its header or reopen it to resume (dropping a torn last line);
        ``files`` go into a new header (see :meth:`check`)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        lock = ResultsLock.acquire(path)
        try:
            records, torn = cls._existing(path, spec_hash, files, legacy_hash)
            if records:
                if torn is not None:
                    with open(path, "r+b") as fh:
                        fh.truncate(torn)
            else:
                header = {"kind": "header", "format": FORMAT, "version": VERSION, "spec_hash": spec_hash,
                          "spec": spec, **({"files": dict(files)} if files is not None else {})}
                line = _checked_line(header, RecordChecker(), path, 1)
                with open(path, "wb"):  # empty, or only our own torn header (checked above)
                    pass
                append_line_durable(path, line)
                records = [json.loads(line)]
            writer = cls(path, spec_hash, records, lock)
        except BaseException:
            lock.release()
            raise
        return writer

    def close(self) -> None:
        """Release the lock (appending after this is an error)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def append(self, record: dict[str, Any]) -> None:
        """Check one record as the reader will, then write it durably; a result record marks its
        (policy, task, item) done."""
        append_line_durable(self.path, _checked_line(record, self._checker, self.path, self._checker.lines + 1))
        if record["kind"] == "result":
            self.done.add((record["policy"], record["task"], record["item"]))
        elif record["kind"] == "policy":
            self.policies[record["policy"]] = record


def _resumes(header: dict, spec_hash: str, legacy_hash: str | None) -> bool:
    """The study of ``spec_hash`` may resume the file of ``header``: the same hash, or a version-1 header (no
    ``files``) under the hash that version gave the same study (it did not cover side files)."""
    theirs = header["spec_hash"]
    return theirs == spec_hash or (legacy_hash is not None and "files" not in header and theirs == legacy_hash)


def _other_study(path: str, header: dict, spec_hash: str, files: dict[str, str] | None) -> StudyError:
    theirs = header["spec_hash"]
    changed = _changed_file(header.get("files"), files)
    if changed:
        return StudyError(f"{path}: this results file belongs to another study: {changed} since it was begun (spec "
                          f"hash {theirs}, now {spec_hash}), so its results came from other data; restore that file, "
                          "or pass another results path to start over")
    return StudyError(f"{path}: this results file belongs to another study (spec hash {theirs}, this spec is "
                      f"{spec_hash}); pass another results path, or delete the file to start over")


def _changed_file(recorded: dict[str, str] | None, files: dict[str, str] | None) -> str | None:
    """What differs between the files a header recorded and the study's files now (the first path), or None."""
    if recorded is None or files is None:
        return None
    for path in sorted(set(recorded) | set(files)):
        if path not in files:
            return f"{path} is gone"
        if path not in recorded:
            return f"{path} appeared"
        if recorded[path] != files[path]:
            return f"{path} changed"
    return None


def _header_of(path: str) -> dict | None:
    """The valid header on line 1 of ``path``, else None."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 26)
        if not first.endswith(b"\n"):
            return None
        return RecordChecker().check(loads_strict(first.decode("utf-8")), 1)
    except (OSError, ValueError):  # UnicodeDecodeError, JsonInputError and BadField are ValueErrors
        return None


def _checked_line(record: Any, checker: RecordChecker, path: str, line: int) -> str:
    """The JSON line of ``record``, which must be one the reader accepts (else nothing is written)."""
    try:
        text = json.dumps(record, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StudyError(f"{path}: refusing to write line {line}: {exc}; nothing was written (this is a bug in "
                         "whatever made the record: please report it)") from None
    try:
        checker.check(json.loads(text), line)
        return text
    except BadField as exc:
        raise StudyError(f"{path}: refusing to write line {line}" + (f", field '{exc.field}'" if exc.field else "")
                         + f": {exc.problem}; nothing was written (this is a bug in whatever made the record: "
                           "please report it)") from None


@attrs.define
class Results:
    """A results file read back for reports: policies, per-item results, aligned score vectors."""

    path: str
    header: dict
    policies: dict[str, dict]
    """Policy name -> its policy record (plan, nominal bytes, budget, method, role)."""
    results: list[dict]

    @classmethod
    def load(cls, path: str) -> "Results":
        """The results file at ``path``; a plan-file policy (no solver budget) is placed at the budget its plan's
        provenance names (``{"ratio": 8.0}`` -> ``"8x"``), so the per-budget analyses compare it with the solved
        plans of that budget."""
        records = read_records(path)
        policies = {r["policy"]: with_plan_budget(r) for r in records if r.get("kind") == "policy"}
        results = [r for r in records if r.get("kind") == "result"]
        return cls(path=path, header=records[0], policies=policies, results=results)

    @property
    def tasks(self) -> list[str]:
        return sorted({r["task"] for r in self.results})

    def policy_names(self) -> list[str]:
        """Policies in the order they were first recorded."""
        return list(self.policies)

    def for_task(self, task: str) -> "Results":
        """These results with only the policies that ran ``task`` (parts of a combined study may leave a task out:
        a part run at fewer budgets, or on other tasks)."""
        ran = {r["policy"] for r in self.results if r["task"] == task}
        if ran >= set(self.policies):
            return self
        return attrs.evolve(self, policies={n: r for n, r in self.policies.items() if n in ran},
                            results=[r for r in self.results if r["policy"] in ran])

    def items(self, task: str) -> list[str]:
        """Item ids of ``task`` finished by every policy that has results (the paired set)."""
        by_policy = defaultdict(set)
        for r in self.results:
            if r["task"] == task:
                by_policy[r["policy"]].add(r["item"])
        if not by_policy:
            return []
        common = set.intersection(*by_policy.values())
        return sorted(common, key=_item_order)

    def scores(self, policy: str, task: str, items: Iterable[str] | None = None) -> np.ndarray:
        """[n] scores of ``policy`` on ``items`` (default: the paired set of ``task``), in that order; empty when the
        policy did not run ``task`` at all (a part of a combined study that left the task out)."""
        items = self.items(task) if items is None else list(items)
        table = {r["item"]: r["score"] for r in self.results if r["policy"] == policy and r["task"] == task}
        if not table:
            return np.array([], dtype=np.float64)
        missing = [i for i in items if i not in table]
        if missing:
            raise StudyError(f"{self.path}: policy '{policy}' has no result for {len(missing)} item(s) of task "
                             f"'{task}' (e.g. {missing[0]}); finish the study (run it again to resume)")
        return np.array([table[i] for i in items], dtype=np.float64)

    def field(self, policy: str, task: str, name: str) -> np.ndarray:
        """[n] values of result field ``name`` (e.g. ``kv_bytes``) over the policy's items of ``task``."""
        return np.array([r[name] for r in self.results if r["policy"] == policy and r["task"] == task],
                        dtype=np.float64)


def _item_order(item: str):
    head, _, tail = item.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (item, -1)


def budget_label(budget) -> str | None:
    """The spec's budget string of a plan's ``provenance.budget``: ``{"ratio": 8.0}`` -> ``"8x"``, ``{"bytes": n}``
    -> ``"n"``, ``{"tokens": n}`` -> ``"ntok"``; None for anything else."""
    if not isinstance(budget, dict) or len(budget) != 1:
        return None
    (kind, value), = budget.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind == "ratio":
        return f"{float(value):g}x"
    if kind in ("bytes", "tokens") and float(value).is_integer():
        return f"{int(value)}" + ("tok" if kind == "tokens" else "")
    return None


def with_plan_budget(rec: dict) -> dict:
    """``rec`` (a policy record) with ``budget`` taken from its plan's provenance when the study gave it none."""
    if rec.get("budget") is not None or rec.get("role") == "full" or not isinstance(rec.get("plan"), dict):
        return rec
    label = budget_label((rec["plan"].get("provenance") or {}).get("budget"))
    return rec if label is None else {**rec, "budget": label}
