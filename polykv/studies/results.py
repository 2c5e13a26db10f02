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
from typing import Any, Iterable

import attrs
import numpy as np

from polykv.atomic import append_line_durable
from polykv.errors import StudyError

FORMAT = "polykv-study-results"
VERSION = 1


def _read_lines(path: str) -> tuple[list[dict], int | None]:
    """Parsed records, and the byte offset of a torn last line (None when the file ends cleanly)."""
    records, offset = [], 0
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if not line.strip():
            offset += len(line) + 1
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if last:  # written without its newline: the process stopped mid-line
                return records, offset
            raise StudyError(f"{path} line {i + 1}: not a JSON record; the results file is damaged "
                             "(remove that line, or start a new results file)") from None
        if last:  # a complete record without its newline is still torn: the newline never arrived
            return records[:-1], offset
        offset += len(line) + 1
    return records, None


def read_records(path: str) -> list[dict]:
    """All complete records of a results file (header first); a torn last line is ignored."""
    if not os.path.isfile(path):
        raise StudyError(f"{path}: no such results file")
    records, _ = _read_lines(path)
    if not records or records[0].get("kind") != "header" or records[0].get("format") != FORMAT:
        raise StudyError(f"{path}: not a polykv study results file (its first line is not a "
                         f"'{FORMAT}' header)")
    return records


class ResultsWriter:
    """Append-only results of one study; refuses a file written by another study."""

    def __init__(self, path: str, spec_hash: str, records: list[dict]):
        self.path, self.spec_hash = path, spec_hash
        self.done: set[tuple[str, str, str]] = {(r["policy"], r["task"], r["item"]) for r in records
                                                if r.get("kind") == "result"}
        self.policies: dict[str, dict] = {r["policy"]: r for r in records if r.get("kind") == "policy"}

    @classmethod
    def check(cls, path: str, spec_hash: str) -> list[dict]:
        """Records of an existing file of this study ([] when there is none); else a StudyError."""
        if not os.path.exists(path) or not _read_lines(path)[0]:
            return []  # no file, or only a torn header: start afresh
        records = read_records(path)
        theirs = records[0].get("spec_hash")
        if theirs != spec_hash:
            raise StudyError(f"{path}: this results file belongs to another study (spec hash {theirs}, this spec "
                             f"is {spec_hash}); pass another results path, or delete the file to start over")
        return records

    @classmethod
    def open(cls, path: str, spec_hash: str, spec: dict[str, Any]) -> "ResultsWriter":
        """Create the file with its header, or reopen it to resume (dropping a torn last line)."""
        records = cls.check(path, spec_hash)
        if records:
            _, torn = _read_lines(path)
            if torn is not None:
                with open(path, "r+b") as fh:
                    fh.truncate(torn)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            header = {"kind": "header", "format": FORMAT, "version": VERSION, "spec_hash": spec_hash, "spec": spec}
            if os.path.exists(path):
                os.unlink(path)
            append_line_durable(path, json.dumps(header, sort_keys=True))
            records = [header]
        return cls(path, spec_hash, records)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably; a result record marks its (policy, task, item) done."""
        append_line_durable(self.path, json.dumps(record, sort_keys=True, allow_nan=False))
        if record["kind"] == "result":
            self.done.add((record["policy"], record["task"], record["item"]))
        elif record["kind"] == "policy":
            self.policies[record["policy"]] = record


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
        records = read_records(path)
        policies = {r["policy"]: r for r in records if r.get("kind") == "policy"}
        results = [r for r in records if r.get("kind") == "result"]
        return cls(path=path, header=records[0], policies=policies, results=results)

    @property
    def tasks(self) -> list[str]:
        return sorted({r["task"] for r in self.results})

    def policy_names(self) -> list[str]:
        """Policies in the order they were first recorded."""
        return list(self.policies)

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
        """[n] scores of ``policy`` on ``items`` (default: the paired set of ``task``), in that order."""
        items = self.items(task) if items is None else list(items)
        table = {r["item"]: r["score"] for r in self.results if r["policy"] == policy and r["task"] == task}
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
