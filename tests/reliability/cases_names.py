"""Names that are not labels, side files that changed under a study, aliases of one results file, results from a
newer polykv: each refused in one line before anything is created.

- ``names``: a study, plan or solver name that is a path, not a string, empty, or holds a control character
  (``polykv study SPEC`` with the default results path, and ``--check``).
- ``sidefiles``: a resumed study whose plan's ``model_data`` file or profile side file changed, appeared or
  vanished since the results file was begun.
- ``alias``: a second run on a hard link of a results file another run holds.
- ``newer``: a results file whose header says a format version newer than this polykv reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cases import _HELD, _study, add, mutate, plan_dict, spec_dict, write, write_jsonl

from polykv.studies.results import ResultsWriter
from polykv.studies.spec import load_spec

# -- study, plan and solver names ---------------------------------------------------------------------------
BAD_NAMES: list[tuple[str, Any]] = [
    ("dotdot", "../../escaped-study"),
    ("parent", "../escaped"),
    ("absolute", None),  # the case folder's own absolute path + /abs
    ("slash", "a/b"),
    ("backslash", "a\\b"),
    ("dot", "."),
    ("two-dots", ".."),
    ("int", 5),
    ("null", None),
    ("list", ["a"]),
    ("empty", ""),
    ("blank", "   "),
    ("newline", "a\nb"),
    ("tab", "a\tb"),
    ("nul", "a\x00b"),
    ("escape", "a\x1b[2Jb"),
    ("line-separator", "a\u2028b"),
    ("long", "x" * 300),
]
# what a bad study name could create: the default results folder, and the places a path name points at
NAME_OUTPUTS = ("results", "escaped", "abs", "a", "x" * 300)


def _named(key: str, value: Any, *, check: bool):
    def setup(d: Path) -> list[str]:
        v = str(d / "abs") if key == "absolute" else value
        spec = mutate(spec_dict(), "name", v)
        return _study(d, spec)[:2] + (["--check"] if check else ["--no-progress"])
    return setup


for _key, _value in BAD_NAMES:
    add(f"names-study-{_key}", "spec", _named(_key, _value, check=False), "spec.json: field 'name'", NAME_OUTPUTS)
    add(f"names-study-check-{_key}", "spec", _named(_key, _value, check=True), "spec.json: field 'name'",
        NAME_OUTPUTS)


def _default_name(d: Path) -> list[str]:
    """No "name": the study is named after its spec file, here one whose name holds a newline."""
    spec = spec_dict()
    del spec["name"]
    _study(d, spec)
    (d / "spec.json").rename(d / "a\nb.json")
    return ["study", str(d / "a\nb.json"), "--no-progress"]


add("names-study-from-file-name", "spec", _default_name, "field 'name'", NAME_OUTPUTS)

POLICY_NAMES = [("dotdot", "../x"), ("slash", "a/b"), ("absolute", "/tmp/x"), ("newline", "a\nb"), ("empty", ""),
                ("dot", "."), ("nul", "a\x00b"), ("long", "p" * 300)]
for _key, _value in POLICY_NAMES:
    add(f"names-plan-{_key}", "spec", lambda d, v=_value: _study(d, mutate(spec_dict(), "plans", {v: "plan.json"})),
        "spec.json: field 'plans'", ("r.jsonl",))

    def _solver(d: Path, v=_value) -> list[str]:
        spec = spec_dict()
        spec.update(profile="prof.json", budgets=["2x"], solvers=[{"name": v, "solver": "exact"}])
        return _study(d, spec)
    add(f"names-solver-{_key}", "spec", _solver, "spec.json: field 'solvers[0].name'", ("r.jsonl",))


# -- side files that changed under a study ------------------------------------------------------------------
def _begun(d: Path, spec: dict, side: dict[str, bytes], plan: dict | None = None) -> list[str]:
    """A results file begun by this study (header, one policy, one result) with the side files as ``side`` says;
    ``polykv study --check`` is then pointed at it."""
    argv = _study(d, spec, plan=plan)
    for name, content in side.items():
        write(d, name, content)
    writer = ResultsWriter.for_study(str(d / "r.jsonl"), load_spec(str(d / "spec.json")))
    writer.append({"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full",
                   "plan": None})
    writer.append({"kind": "result", "policy": "full", "task": "passkey", "item": "passkey-0", "score": 1.0,
                   "kv_bytes": 1000, "full_kv_bytes": 1000, "context_tokens": 256})
    writer.close()
    return argv


def _stats_plan(stats: str) -> dict:
    """The plan with a TriAttention layer reading query statistics from ``stats``."""
    d = mutate(plan_dict(), "layers.0.prefill", {"rule": "triattention", "capacity": 64})
    d["model_data"] = {"triattention": stats}
    return d


def _solver_spec() -> dict:
    spec = spec_dict()
    spec.update(profile="prof.json", budgets=["2x"], solvers=[{"name": "mine2", "solver": "exact"}])
    return spec


STATS = "plan.qstats.safetensors"
QSTATS = "prof.qstats.safetensors"
BASES = "prof.kvbases.safetensors"

# (id, spec, plan file (None: the default), side file, its content when the results file was begun and now;
# None: absent)
SIDE_CASES = [
    ("plan-model-data-changed", spec_dict, _stats_plan(STATS), STATS, b"old statistics", b"new statistics"),
    ("plan-model-data-removed", spec_dict, _stats_plan(STATS), STATS, b"old statistics", None),
    ("plan-model-data-appeared", spec_dict, _stats_plan(STATS), STATS, None, b"new statistics"),
    ("profile-qstats-changed", _solver_spec, None, QSTATS, b"old statistics", b"new statistics"),
    ("profile-qstats-appeared", _solver_spec, None, QSTATS, None, b"new statistics"),
    ("profile-bases-changed", _solver_spec, None, BASES, b"old bases", b"new bases"),
]
for _id, _spec, _plan, _name, _before, _after in SIDE_CASES:
    def _setup(d: Path, s=_spec, p=_plan, n=_name, b=_before, a=_after) -> list[str]:
        argv = _begun(d, s(), {n: b} if b is not None else {}, plan=p)
        if a is None:
            (d / n).unlink()
        else:
            write(d, n, a)
        return argv
    add(f"sidefiles-{_id}", "spec", _setup, _name)


# -- two runs on aliases of one results file ----------------------------------------------------------------
class _Held:
    """A results writer another run holds open, released after the case (what ``_HELD`` expects)."""

    def __init__(self, writer):
        self.writer = writer

    def release(self) -> None:
        self.writer.close()


def _hard_link(*, check: bool):
    def setup(d: Path) -> list[str]:
        argv = _study(d, spec_dict())
        _HELD.append(_Held(ResultsWriter.for_study(str(d / "r.jsonl"), load_spec(str(d / "spec.json")))))
        (d / "sub").mkdir()
        (d / "sub" / "alias.jsonl").hardlink_to(d / "r.jsonl")
        return argv[:2] + (["--check"] if check else ["--no-progress"]) + ["--results", str(d / "sub" / "alias.jsonl")]
    return setup


add("alias-hard-link-check", "spec", _hard_link(check=True), "alias.jsonl: another polykv run holds")
add("alias-hard-link-run", "spec", _hard_link(check=False), "alias.jsonl: another polykv run holds")


# -- results written by a newer polykv ----------------------------------------------------------------------
def _newer_lines(version: int, spec_hash: str = "spec-0") -> list[Any]:
    return [{"format": "polykv-study-results", "kind": "header", "spec": {"name": "x", "context_tokens": 256},
             "spec_hash": spec_hash, "version": version, "written_by": "polykv 9"},
            {"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full", "plan": None,
             "colour": "new field"}]


for _v in (3, 99):
    add(f"newer-report-v{_v}", "results", lambda d, v=_v: [
        "report", write_jsonl(d, "r.jsonl", _newer_lines(v)), "-o", str(d / "rep")], "written by a newer polykv",
        ("rep",))

    def _resume(d: Path, v=_v) -> list[str]:
        argv = _study(d, spec_dict())
        write_jsonl(d, "r.jsonl", _newer_lines(v, load_spec(str(d / "spec.json")).hash))
        return argv
    add(f"newer-resume-v{_v}", "results", _resume, "written by a newer polykv")
    add(f"newer-report-torn-v{_v}", "results", lambda d, v=_v: [
        "report", write(d, "r.jsonl", '{"format": "polykv-study-results", "kind": "header", "spec": {}, '
                                      f'"spec_hash": "s", "version": {v}' + "}\n" + '{"kind": "pol'),
        "-o", str(d / "rep")], "written by a newer polykv", ("rep",))
