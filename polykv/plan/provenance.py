"""A plan file's ``provenance``, read strictly: where the plan came from (solver, budget, predictions, time).

A hand-made plan's provenance is the empty one (:data:`NO_PROVENANCE`, what polykv writes for ``Provenance()``)
and needs no reading; a solver's is read field by field (:func:`parse_provenance`), a budget, a time and the
basis fields when given. Every error is a :class:`polykv.errors.PlanError` naming the file and the dotted field.
"""

from __future__ import annotations

import datetime
from typing import Any

import attrs

from polykv.plan.records import (BASES, BUDGET_KINDS, MAX_BATCH, MAX_BUDGET_VALUE, MAX_CONTEXT_TOKENS, MAX_LOSS,
                                 STORAGE_DTYPE_BYTES, Provenance)
from polykv.plan.writing import provenance_dict
from polykv.strict_json import FieldReader

NO_PROVENANCE = provenance_dict(Provenance())
"""The ``provenance`` object polykv writes for a plan made by hand (every field null or empty)."""


def parse_provenance(r: FieldReader, raw: Any) -> Provenance:
    """Where the plan came from; a budget, a time and the basis fields are read when given (a hand-made plan's
    are null or absent)."""
    r.obj(raw, "provenance", optional=[f.name for f in attrs.fields(Provenance)])
    f = "provenance."
    given = {key for key in ("budget", "created", "basis", "cache_dtype") if raw.get(key) is not None}
    return Provenance(
        solver=r.str_(raw.get("solver"), f + "solver", optional=True),
        params=r.dict_(raw.get("params", {}), f + "params"),
        budget=_budget(r, raw["budget"], f + "budget") if "budget" in given else None,
        context_tokens=r.int_(raw.get("context_tokens"), f + "context_tokens", minimum=1,
                              maximum=MAX_CONTEXT_TOKENS, optional=True),
        predicted_loss=r.float_(raw.get("predicted_loss"), f + "predicted_loss", optional=True, minimum=0.0,
                                maximum=MAX_LOSS),
        predicted_bytes=r.int_(raw.get("predicted_bytes"), f + "predicted_bytes", minimum=0,
                               maximum=MAX_BUDGET_VALUE, optional=True),
        profile_fingerprint=r.str_(raw.get("profile_fingerprint"), f + "profile_fingerprint", optional=True),
        polykv_version=r.str_(raw.get("polykv_version"), f + "polykv_version", optional=True),
        created=_created(r, raw["created"], f + "created") if "created" in given else None,
        note=r.str_(raw.get("note", ""), f + "note"),
        basis=_choice(r, raw["basis"], f + "basis", BASES, "basis") if "basis" in given else None,
        batch=r.int_(raw.get("batch"), f + "batch", minimum=1, maximum=MAX_BATCH, optional=True),
        cache_dtype=_choice(r, raw["cache_dtype"], f + "cache_dtype", tuple(STORAGE_DTYPE_BYTES), "cache dtype")
        if "cache_dtype" in given else None,
        measured=r.dict_(raw.get("measured"), f + "measured", optional=True),
    )


def _choice(r: FieldReader, value: Any, field: str, choices: tuple[str, ...], what: str) -> str:
    return r.choice(r.str_(value, field), field, choices, what)


def _budget(r: FieldReader, value: Any, field: str) -> dict:
    """``{"ratio": 8.0}``, ``{"bytes": N}`` or ``{"tokens_per_layer": N}``: one kind, a positive finite value."""
    budget = r.dict_(value, field)
    if len(budget) != 1 or next(iter(budget)) not in BUDGET_KINDS:
        r.fail(f"expected one budget kind, got {sorted(budget)}", field=field,
               hint="e.g. {\"ratio\": 8.0}, {\"bytes\": 1048576} or {\"tokens_per_layer\": 256}")
    kind, amount = next(iter(budget.items()))
    r.float_(amount, f"{field}.{kind}", minimum=1, maximum=MAX_BUDGET_VALUE)
    return budget


def _created(r: FieldReader, value: Any, field: str) -> str:
    created = r.str_(value, field)
    try:
        datetime.datetime.fromisoformat(created)
    except ValueError:
        r.fail(f"expected an ISO-8601 time like \"2026-01-31T12:00:00+00:00\", got {created!r}", field=field,
               hint="write the time polykv writes, or leave the field out")
    return created

