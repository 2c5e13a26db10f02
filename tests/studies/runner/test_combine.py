"""Parts of one experiment reported together: paired item by item, the shared baseline read once, and parts of
different experiments refused in one line."""

from __future__ import annotations

import json

import pytest

from polykv.cli import main
from polykv.errors import StudyError
from polykv.studies.combine import combine_results
from polykv.studies.report import policy_rows
from polykv.studies.results import FORMAT

SPEC = {"model": "default", "dtype": "float32", "storage_dtype": "bfloat16", "basis": "resident",
        "context_tokens": 100, "bos": "auto", "prompt_format": "plain",
        "tasks": [{"task": "passkey", "params": {"length": 100}, "samples": 6, "seed": 0}]}


def _part(path, name, scores: dict[str, list[float]], *, spec=None, answers=None, plans=None):
    spec = {**SPEC, "name": name, **(spec or {})}
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": f"spec-{name}", "spec": spec}]
    for policy in scores:
        lines.append({"kind": "policy", "policy": policy, "method": policy.split("@")[0],
                      "budget": None if policy == "full" else "8x", "role": "full" if policy == "full" else "",
                      "plan": (plans or {}).get(policy), "nominal_bytes": None})
    for policy, values in scores.items():
        for i, s in enumerate(values):
            lines.append({"kind": "result", "policy": policy, "task": "passkey", "item": f"passkey-{i}", "score": s,
                          "kv_bytes": 1000 if policy == "full" else 125, "full_kv_bytes": 1000,
                          "context_tokens": 100, "answers": [(answers or {}).get(i, str(1000 + i))]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


FULL = [1, 1, 1, 0, 1, 1]


def test_parts_pair_item_by_item_and_the_baseline_is_read_once(tmp_path):
    a = _part(tmp_path / "a.jsonl", "a", {"full": FULL, "x@8x": [1, 0, 1, 0, 0, 1]})
    b = _part(tmp_path / "b.jsonl", "b", {"full": FULL[:4], "y@8x": [0, 0, 1, 0]})
    res = combine_results([a, b])
    assert res.policy_names() == ["full", "x@8x", "y@8x"]
    assert sum(r["policy"] == "full" for r in res.results) == 6        # b's four repeats are not counted twice
    assert res.items("passkey") == [f"passkey-{i}" for i in range(4)]  # the paired set: what every policy finished
    rows = {r["policy"]: r for r in policy_rows(res, "passkey")}
    assert rows["y@8x"]["wilson"].estimate == pytest.approx(0.25)


def test_the_report_verb_takes_several_parts(tmp_path):
    a = _part(tmp_path / "a.jsonl", "a", {"full": FULL, "x@8x": [1, 0, 1, 0, 0, 1]})
    b = _part(tmp_path / "b.jsonl", "b", {"full": FULL, "y@8x": [0, 0, 1, 0, 1, 1]})
    assert main(["report", a, b, "-o", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| x@8x |" in md and "| y@8x |" in md and "a + b" in md


@pytest.mark.parametrize("change, words", [
    ({"spec": {"context_tokens": 200}}, "field 'context_tokens'"),
    ({"spec": {"basis": "nominal"}}, "field 'basis'"),
    ({"spec": {"tasks": [{"task": "passkey", "params": {"length": 100}, "samples": 6, "seed": 1}]}},
     "task 'passkey'"),
    ({"answers": {2: "999"}}, "item 'passkey-2' of task 'passkey' has another prompt"),
])
def test_parts_of_different_experiments_are_refused(tmp_path, change, words):
    a = _part(tmp_path / "a.jsonl", "a", {"full": FULL})
    b = _part(tmp_path / "b.jsonl", "b", {"full": FULL, "y@8x": FULL}, **change)
    with pytest.raises(StudyError) as err:
        combine_results([a, b])
    assert words in str(err.value) and "b.jsonl" in str(err.value) and "\n" not in str(err.value)


def test_a_shared_policy_must_agree(tmp_path):
    a = _part(tmp_path / "a.jsonl", "a", {"full": FULL})
    b = _part(tmp_path / "b.jsonl", "b", {"full": [0] + FULL[1:]})
    with pytest.raises(StudyError, match="policy 'full' scores 0 on item 'passkey-0' but 1 in"):
        combine_results([a, b])
    c = _part(tmp_path / "c.jsonl", "c", {"full": FULL, "x@8x": FULL}, plans={"x@8x": {"layers": [1]}})
    d = _part(tmp_path / "d.jsonl", "d", {"full": FULL, "x@8x": FULL}, plans={"x@8x": {"layers": [2]}})
    with pytest.raises(StudyError, match="policy 'x@8x' runs another plan"):
        combine_results([c, d])
    # The same plan, made another way (its provenance) or read with per-model data from elsewhere, is one policy.
    e = _part(tmp_path / "e.jsonl", "e", {"full": FULL, "x@8x": FULL},
              plans={"x@8x": {"layers": [1], "provenance": {"note": "by hand"}, "model_data": {"k": "/a/f"}}})
    f = _part(tmp_path / "f.jsonl", "f", {"full": FULL, "x@8x": FULL},
              plans={"x@8x": {"layers": [1], "provenance": {"note": "solved"}, "model_data": {"k": "/b/f"}}})
    assert "x@8x" in combine_results([e, f]).policies
    with pytest.raises(StudyError, match="given twice"):
        combine_results([a, a])


def test_a_part_that_left_a_task_out_is_reported_on_the_tasks_it_ran(tmp_path):
    a = _part(tmp_path / "a.jsonl", "a", {"full": FULL, "x@8x": [1, 0, 1, 0, 0, 1]})
    b = _part(tmp_path / "b.jsonl", "b", {"full": FULL, "y@8x": [0, 0, 1, 0, 1, 1]},
              spec={"tasks": SPEC["tasks"] + [{"task": "niah", "params": {"length": 100}, "samples": 6, "seed": 0}]})
    lines = [json.loads(x) for x in open(b)]
    for i in range(6):  # b also ran niah; a did not
        for policy, s in (("full", 1.0), ("y@8x", float(i % 2))):
            lines.append({"kind": "result", "policy": policy, "task": "niah", "item": f"niah-{i}", "score": s,
                          "kv_bytes": 125, "full_kv_bytes": 1000, "context_tokens": 100, "answers": ["1"]})
    open(b, "w").write("".join(json.dumps(x) + "\n" for x in lines))
    res = combine_results([a, b])
    assert res.scores("x@8x", "niah").size == 0
    assert sorted(res.for_task("niah").policies) == ["full", "y@8x"]
    assert sorted(res.for_task("passkey").policies) == ["full", "x@8x", "y@8x"]
    assert [r["policy"] for r in policy_rows(res.for_task("niah"), "niah")] == ["full", "y@8x"]
    assert main(["report", a, b, "-o", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Task `niah`" in md and "## Task `passkey`" in md
    # A policy that ran a task but not all of its items is still an unfinished study, and says so.
    with pytest.raises(StudyError, match="has no result for 2 item"):
        res.scores("x@8x", "passkey", [f"passkey-{i}" for i in range(8)])
