"""Several results files read as one study: parts of a study run separately (other policies, other tasks, another
machine) and reported together, paired item by item.

>>> res = combine_results(["part-a/results.jsonl", "part-b/results.jsonl"])   # doctest: +SKIP

Parts combine only when they are the same experiment: the same model, dtypes, memory basis, context length and
prompt rule; a task that appears in several parts has the same parameters and seed there, and every item they
share has the same answers and context length (the same prompt). A policy recorded in several parts (the full
baseline, typically) must run the same plan (its provenance, which only says how it was made, may differ) and
have the same score on every shared item: it is read once. Anything
else is refused in one line naming both files and the field.
"""

from __future__ import annotations

import json
from typing import Sequence

from polykv.errors import StudyError
from polykv.studies.results import Results

SAME_EXPERIMENT = ("model", "dtype", "storage_dtype", "basis", "context_tokens", "bos", "prompt_format")
"""Spec fields every part must share."""


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True)


def executed_plan(plan):
    """What of a recorded plan decides what runs: all but its provenance (how it was made, a note) and its
    ``model_data`` file paths (where per-model data was read; the data is checked against the model anyway)."""
    if not isinstance(plan, dict):
        return plan
    return {k: v for k, v in plan.items() if k not in ("provenance", "model_data")}


def _check_specs(parts: Sequence[Results]) -> None:
    first = parts[0]
    tasks: dict[str, tuple[str, dict]] = {}
    for part in parts:
        spec = part.header["spec"]
        for key in SAME_EXPERIMENT:
            if _canon(spec.get(key)) != _canon(first.header["spec"].get(key)):
                raise StudyError(f"{part.path}: field '{key}' is {spec.get(key)!r} but {first.path} has "
                                 f"{first.header['spec'].get(key)!r}; only parts of the same experiment combine")
        for entry in spec.get("tasks", []):
            name = entry["task"]
            if name in tasks and _canon(tasks[name][1]) != _canon(entry):
                raise StudyError(f"{part.path}: task '{name}' is {_canon(entry)} but {tasks[name][0]} has "
                                 f"{_canon(tasks[name][1])}; a task combines only with the same params, samples "
                                 f"and seed")
            tasks.setdefault(name, (part.path, entry))


def _same_items(parts: Sequence[Results]) -> None:
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    for part in parts:
        for r in part.results:
            key = (r["task"], r["item"])
            prompt = _canon({"answers": r.get("answers"), "context_tokens": r.get("context_tokens")})
            if key in seen and seen[key][1] != prompt:
                raise StudyError(f"{part.path}: item '{r['item']}' of task '{r['task']}' has another prompt than in "
                                 f"{seen[key][0]} (answers or context length differ); the parts drew different "
                                 f"items and cannot be paired")
            seen.setdefault(key, (part.path, prompt))


def combine_results(paths: Sequence[str]) -> Results:
    """One :class:`Results` over every part in ``paths`` (see the module docstring); one path reads as it is."""
    paths = list(paths)
    if not paths:
        raise StudyError("no results file given")
    if len(set(paths)) != len(paths):
        raise StudyError(f"results file(s) {sorted({p for p in paths if paths.count(p) > 1})} given twice")
    parts = [Results.load(p) for p in paths]
    if len(parts) == 1:
        return parts[0]
    _check_specs(parts)
    _same_items(parts)
    policies: dict[str, dict] = {}
    owner: dict[str, Results] = {}  # the part whose policy record is kept
    results: list[dict] = []
    scores: dict[tuple[str, str, str], tuple[float, str]] = {}
    for part in parts:
        for name, rec in part.policies.items():
            if name not in policies:
                policies[name], owner[name] = rec, part
                continue
            if _canon(executed_plan(rec.get("plan"))) != _canon(executed_plan(policies[name].get("plan"))):
                raise StudyError(f"{part.path}: policy '{name}' runs another plan than in {owner[name].path}; "
                                 f"rename one of them in its spec")
        for r in part.results:
            key = (r["policy"], r["task"], r["item"])
            if key in scores:
                _check_repeat(part, scores[key], r)
            else:
                results.append(r)
                scores[key] = (r["score"], part.path)
    header = dict(parts[0].header)
    spec = dict(header["spec"])
    spec["name"] = " + ".join(str(p.header["spec"].get("name")) for p in parts)
    spec["tasks"] = _union_tasks(parts)
    header.update(spec=spec, spec_hash=" + ".join(p.header["spec_hash"] for p in parts))
    return Results(path=" + ".join(paths), header=header, policies=policies, results=results)


def _check_repeat(part: Results, first: tuple[float, str], r: dict) -> None:
    """A policy's result recorded again in a later part must equal the first one."""
    if first[0] != r["score"]:
        raise StudyError(f"{part.path}: policy '{r['policy']}' scores {r['score']} on item '{r['item']}' "
                         f"but {first[0]} in {first[1]}; the parts did not run the same experiment")


def _union_tasks(parts: Sequence[Results]) -> list[dict]:
    out: dict[str, dict] = {}
    for part in parts:
        for entry in part.header["spec"].get("tasks", []):
            out.setdefault(entry["task"], entry)
    return list(out.values())
