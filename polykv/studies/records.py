"""The record types of a study results file and the range of every field (what :mod:`.results` checks).

One table per kind of line (``header``, ``policy``, ``result``): each field's check and whether it is
required. A field no table names is refused (a misspelt field would otherwise be silently ignored).
The ranges are those the runner writes: a score is a task metric in [0, 1]
(:meth:`polykv.studies.tasks.base.Task.score`; teacher-forced tasks score the top-1 agreement), byte
counts and token counts are whole numbers >= 0, KL divergences are >= 0 (clamped so in
:func:`polykv.studies.fidelity.compare`), perplexities are positive, times are seconds >= 0.

:class:`RecordChecker` reads the lines of one file in order: the header first and only there, every
policy once, every result once and only for a policy declared on an earlier line.
"""

from __future__ import annotations

import math
from typing import Any, Callable

FORMAT = "polykv-study-results"
VERSION = 2
"""The format version this polykv writes; it reads every version from 1 up to this one. Version 2 headers add
``files``, the sha256 of every file the study reads (plans, profile, task files and the side files they name)."""


class BadField(ValueError):
    """One field of one record is wrong; ``field`` is its dotted name (None: the record as a whole)."""

    def __init__(self, problem: str, field: str | None = None):
        super().__init__(problem)
        self.problem, self.field = problem, field


class NewerVersion(BadField):
    """A header of a format version past :data:`VERSION`: written by a newer polykv, not damaged."""

    def __init__(self, version: int):
        super().__init__(f"written by a newer polykv (results format version {version}; this polykv reads up to "
                         f"version {VERSION})", "version")
        self.version = version


Check = Callable[[Any], str | None]
"""Returns None when the value is valid, else what is wrong with it."""


def _type_name(v: Any) -> str:
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def count(low: int = 0) -> Check:
    def check(v):
        if type(v) is not int:
            return f"expected a whole number >= {low}, got {_type_name(v)} {v!r}"
        return None if v >= low else f"expected a whole number >= {low}, got {v}"
    return check


def number(low: float | None = None, high: float | None = None, *, positive: bool = False) -> Check:
    def check(v):
        want = ("a positive number" if positive else
                f"a number in [{low:g}, {high:g}]" if low is not None and high is not None else
                f"a number >= {low:g}" if low is not None else "a finite number")
        if not _real(v):
            return f"expected {want}, got {_type_name(v)} {v!r}"
        if (positive and v <= 0) or (low is not None and v < low) or (high is not None and v > high):
            return f"expected {want}, got {v!r}"
        return None
    return check


def text(*, empty: bool = False) -> Check:
    def check(v):
        if not isinstance(v, str):
            return f"expected a string, got {_type_name(v)} {v!r}"
        return None if empty or v.strip() else "expected a non-empty string"
    return check


def flag(v):
    return None if isinstance(v, bool) else f"expected true or false, got {_type_name(v)} {v!r}"


def obj(v):
    return None if isinstance(v, dict) else f"expected an object, got {_type_name(v)}"


def optional(inner: Check) -> Check:
    return lambda v: None if v is None else inner(v)


def equal(want: Any) -> Check:
    return lambda v: None if type(v) is type(want) and v == want else f"expected {want!r}, got {v!r}"


def one_of(*choices: Any) -> Check:
    return lambda v: None if any(type(v) is type(c) and v == c for c in choices) else \
        f"expected one of {', '.join(repr(c) for c in choices)}, got {v!r}"


def list_of(inner: Check) -> Check:
    def check(v):
        if not isinstance(v, list):
            return f"expected a list, got {_type_name(v)}"
        for i, x in enumerate(v):
            bad = inner(x)
            if bad:
                return f"item {i}: {bad}"
        return None
    return check


def scalars(v):
    if not isinstance(v, dict):
        return f"expected an object, got {_type_name(v)}"
    for k, x in v.items():
        if not (isinstance(x, (str, bool)) or _real(x)):
            return f"key {k!r}: expected a string, number or true/false, got {_type_name(x)}"
    return None


REQUIRED, OPTIONAL = True, False

SPEC_FIELDS: dict[str, Check] = {
    "name": text(), "model": lambda v: None if isinstance(v, (str, dict)) else
    f"expected a model name or an object, got {_type_name(v)}", "dtype": text(), "context_tokens": count(1),
    "profile": optional(text()), "budgets": list_of(text()), "baseline": flag, "plans": obj,
    "solvers": list_of(obj), "tasks": list_of(obj), "reuse_prefill": flag, "chunk_size": optional(count(1)),
    "bos": one_of("auto", True, False), "prompt_format": text(), "storage_dtype": optional(text()),
    "basis": text(),
}
"""The fields of the header's ``spec`` the reports read (checked when present; others are the spec's own)."""

HEADER: dict[str, tuple[bool, Check]] = {
    "kind": (REQUIRED, equal("header")), "format": (REQUIRED, equal(FORMAT)),
    "version": (REQUIRED, lambda v: None if type(v) is int and 1 <= v <= VERSION else
                f"expected a format version from 1 to {VERSION}, got {v!r}"),
    "spec_hash": (REQUIRED, text()), "spec": (REQUIRED, obj),
    "files": (OPTIONAL, lambda v: None if isinstance(v, dict) and all(isinstance(x, str) for x in v.values()) else
              "expected an object of file path -> sha256"),
}

POLICY: dict[str, tuple[bool, Check]] = {
    "kind": (REQUIRED, equal("policy")), "policy": (REQUIRED, text()),
    "method": (OPTIONAL, optional(text())), "budget": (OPTIONAL, optional(text())),
    "role": (OPTIONAL, optional(text(empty=True))), "solver": (OPTIONAL, optional(text())),
    "index": (OPTIONAL, optional(count(0))), "guided": (OPTIONAL, optional(text())),
    "profile_score": (OPTIONAL, optional(number())), "nominal_bytes": (OPTIONAL, optional(count(0))),
    "predicted_resident_bytes_16bit": (OPTIONAL, optional(count(0))),
    "predicted_held_bytes_16bit": (OPTIONAL, optional(count(0))),
    "full_bytes_16bit": (OPTIONAL, optional(count(0))), "basis": (OPTIONAL, optional(text())),
    "plan": (OPTIONAL, optional(obj)),
}

RESULT: dict[str, tuple[bool, Check]] = {
    "kind": (REQUIRED, equal("result")), "policy": (REQUIRED, text()), "task": (REQUIRED, text()),
    "item": (REQUIRED, text()),
    "score": (REQUIRED, number(0.0, 1.0)),
    "kv_bytes": (REQUIRED, count(0)), "context_tokens": (REQUIRED, count(1)),
    "full_kv_bytes": (REQUIRED, count(0)),
    "full_kv_bytes_16bit": (OPTIONAL, count(0)), "metadata_bytes": (OPTIONAL, count(0)),
    "kv_bytes_per_layer": (OPTIONAL, list_of(count(0))), "kv_bytes_end": (OPTIONAL, count(0)),
    "meta": (OPTIONAL, scalars), "generated": (OPTIONAL, text(empty=True)),
    "answers": (OPTIONAL, list_of(text(empty=True))), "question_tokens": (OPTIONAL, count(0)),
    "new_tokens": (OPTIONAL, count(0)), "continuation_tokens": (OPTIONAL, count(0)),
    "seconds": (OPTIONAL, number(0.0)), "prefill_seconds": (OPTIONAL, optional(number(0.0))),
    "reused_prefill": (OPTIONAL, flag), "bos_first": (OPTIONAL, flag),
    # teacher-forced tasks (polykv.studies.fidelity): all or none
    "kl": (OPTIONAL, number(0.0)), "kl_max": (OPTIONAL, number(0.0)), "top1": (OPTIONAL, number(0.0, 1.0)),
    "ppl": (OPTIONAL, number(positive=True)), "ppl_full": (OPTIONAL, number(positive=True)),
    "positions": (OPTIONAL, count(1)),
}
FIDELITY = ("kl", "kl_max", "top1", "ppl", "ppl_full", "positions")

TABLES = {"header": HEADER, "policy": POLICY, "result": RESULT}


def check_fields(rec: dict, table: dict[str, tuple[bool, Check]]) -> None:
    """Raise :class:`BadField` for the first missing, unknown or out-of-range field of ``rec``."""
    for name, (required, _) in table.items():
        if required and name not in rec:
            raise BadField("missing (every polykv results file has it)", name)
    for name, value in rec.items():
        if name not in table:
            raise BadField(f"not a field of a {rec['kind']} record (known: {', '.join(sorted(table))})", name)
        bad = table[name][1](value)
        if bad:
            raise BadField(bad, name)


class RecordChecker:
    """Checks the records of one results file in order (see the module docstring)."""

    def __init__(self):
        self.lines = 0
        self.policies: dict[str, int] = {}
        self.results: dict[tuple[str, str, str], int] = {}

    def check(self, rec: Any, line: int) -> dict:
        """``rec`` (parsed from line ``line``) when it is a valid next record; else :class:`BadField`."""
        first = not self.lines
        if not isinstance(rec, dict):
            raise BadField(f"a record is a JSON object, got {_type_name(rec)}")
        kind = rec.get("kind")
        if "kind" not in rec:
            raise BadField("missing (header, policy or result)", "kind")
        if not isinstance(kind, str) or kind not in TABLES:
            raise BadField(f"expected header, policy or result, got {kind!r}", "kind")
        if first and kind != "header":
            raise BadField(f"the first line is the header, this is a {kind} record", "kind")
        if not first and kind == "header":
            raise BadField("a second header (a results file has one, on line 1; was another results file "
                           "appended to this one?)", "kind")
        if kind == "header" and type(rec.get("version")) is int and rec["version"] > VERSION:
            raise NewerVersion(rec["version"])  # its other fields may be ones this polykv does not know yet
        check_fields(rec, TABLES[kind])
        if kind == "header":
            for name, value in rec["spec"].items():
                bad = SPEC_FIELDS[name](value) if name in SPEC_FIELDS else None
                if bad:
                    raise BadField(bad, f"spec.{name}")
        elif kind == "policy":
            name = rec["policy"]
            if name in self.policies:
                raise BadField(f"policy {name!r} is already recorded on line {self.policies[name]}", "policy")
            self.policies[name] = line
        else:
            if rec["policy"] not in self.policies:
                raise BadField(f"a result of policy {rec['policy']!r}, which no earlier policy line records",
                               "policy")
            have = [k for k in FIDELITY if k in rec]
            if have and len(have) != len(FIDELITY):
                missing = [k for k in FIDELITY if k not in rec]
                raise BadField(f"a teacher-forced result carries {', '.join(FIDELITY)}; this one lacks "
                               f"{', '.join(missing)}", missing[0])
            key = (rec["policy"], rec["task"], rec["item"])
            if key in self.results:
                raise BadField(f"a second result for policy {key[0]!r}, task {key[1]!r}, item {key[2]!r} (the "
                               f"first is on line {self.results[key]})", "item")
            self.results[key] = line
        self.lines += 1
        return rec
