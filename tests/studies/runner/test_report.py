"""Reports: files are produced from a real run, and their numbers are the paired statistics of the scores."""

from __future__ import annotations

import json

import numpy as np

from polykv.cli import main
from polykv.studies import designs, stats
from polykv.profiling import stats as paired_stats
from polykv.studies.report import policy_rows, write_report
from polykv.studies.results import FORMAT, Results

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_files_are_produced_from_a_study(tmp_path, small_study):
    _, results, records = small_study
    out = tmp_path / "report"
    assert main(["report", results, "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    names = [r["policy"] for r in records if r["kind"] == "policy"]
    for name in names:
        assert f"| {name} |" in md
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures == ["passkey-score-vs-memory.png", "routes-4x.png", "sensitivity.png"]
    for name in figures:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    for name in figures:
        assert f"]({name})" in md


def _write_results(path, scores: dict[str, list[int]], roles: dict[str, str], kv: dict[str, int]):
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "spec-x",
              "spec": {"name": "hand", "context_tokens": 100}}]
    for name, role in roles.items():
        lines.append({"kind": "policy", "policy": name, "method": name.split("@")[0],
                      "budget": None if role == "full" else "8x", "role": role, "plan": None, "nominal_bytes": None})
    for name, values in scores.items():
        for i, s in enumerate(values):
            lines.append({"kind": "result", "policy": name, "task": "passkey", "item": f"passkey-{i}", "score": s,
                          "kv_bytes": kv[name], "full_kv_bytes": 1000, "context_tokens": 100})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_report_numbers_are_the_paired_statistics_of_the_scores(tmp_path):
    rng = np.random.default_rng(3)
    roles = {"full": "full", "2d_uniform@8x": "2d_uniform", "2d@8x": "2d", "2d_hetero@8x": "2d_hetero"}
    scores = {name: [int(x) for x in rng.random(25) < p] for name, p in
              zip(roles, (0.95, 0.4, 0.5, 0.7))}
    kv = {"full": 1000, "2d_uniform@8x": 100, "2d@8x": 125, "2d_hetero@8x": 120}
    path = tmp_path / "results.jsonl"
    _write_results(path, scores, roles, kv)
    res = Results.load(str(path))

    rows = {r["policy"]: r for r in policy_rows(res, "passkey")}
    for name, values in scores.items():
        w = paired_stats.wilson_interval(sum(values), len(values))
        assert (rows[name]["wilson"].low, rows[name]["wilson"].high) == (w.low, w.high)
        assert rows[name]["ratio"] == 1000 / kv[name]

    chain = designs.moend_chain(res, "passkey", "8x")
    want = stats.moend_ablation({"2d_uniform": scores["2d_uniform@8x"], "2d": scores["2d@8x"],
                                 "2d_hetero": scores["2d_hetero@8x"], "full": scores["full"]})
    assert chain["policies"]["full"] == "full"
    for key in ("d_quant", "d_evict", "d_total", "hetero_vs_full"):
        assert chain["intervals"][key] == want[key]

    write_report(str(path), str(tmp_path / "out"))
    md = (tmp_path / "out" / "report.md").read_text()
    d = want["d_evict"]
    assert f"| d_evict | {d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}]" in md
    w = paired_stats.wilson_interval(sum(scores["2d@8x"]), 25)
    assert f"{w.estimate:.1%} [{w.low:.1%}, {w.high:.1%}]" in md


def test_items_missing_for_one_policy_are_left_out_of_the_paired_set(tmp_path):
    roles = {"a@8x": "", "b@8x": ""}
    path = tmp_path / "results.jsonl"
    _write_results(path, {"a@8x": [1, 0, 1], "b@8x": [1, 1]}, roles, {"a@8x": 10, "b@8x": 10})
    res = Results.load(str(path))
    assert res.items("passkey") == ["passkey-0", "passkey-1"]
    assert designs.paired_vs(res, "passkey", "a@8x", "b@8x").estimate == -0.5


def test_policies_at_different_budgets_with_matched_bytes_are_compared(tmp_path):
    path = tmp_path / "results.jsonl"
    roles = {"a@8x": "", "b@8x": "", "c@8x": ""}
    _write_results(path, {"a@8x": [1, 1, 0, 1], "b@8x": [0, 1, 0, 0], "c@8x": [1, 1, 1, 1]}, roles,
                   {"a@8x": 100, "b@8x": 110, "c@8x": 300})
    text = path.read_text().replace('"policy": "b@8x", "method": "b", "budget": "8x"',
                                    '"policy": "b@8x", "method": "b", "budget": "4x"')
    path.write_text(text)
    write_report(str(path), str(tmp_path / "out"))
    md = (tmp_path / "out" / "report.md").read_text()
    section = md.split("matched measured memory")[1].split("###")[0]
    iv = designs.paired_vs(Results.load(str(path)), "passkey", "a@8x", "b@8x")
    assert f"| a@8x | b@8x | 0.91 | {iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]" in section
    assert "c@8x" not in section  # 3x the bytes of either: not a matched pair


def test_bytes_are_measured_with_metadata_against_a_16_bit_cache_and_unequal_pairs_are_flagged(tmp_path):
    path = tmp_path / "results.jsonl"
    roles = {"full": "full", "a@8x": "", "b@8x": "", "c@8x": ""}
    _write_results(path, {n: [1, 0, 1] for n in roles}, roles, {"full": 1000, "a@8x": 100, "b@8x": 102, "c@8x": 90})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for x in lines:
        if x["kind"] == "result":  # a float32 run: the full cache in the run's dtype is twice the 16-bit one
            x.update(metadata_bytes=10, full_kv_bytes=2000, full_kv_bytes_16bit=1000)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = Results.load(str(path))
    rows = {r["policy"]: r for r in policy_rows(res, "passkey")}
    assert rows["a@8x"]["bytes"] == 110 and rows["a@8x"]["ratio"] == 1000 / 110
    warnings = designs.unequal_memory(res, "passkey", ["a@8x", "b@8x", "c@8x"])
    assert len(warnings) == 2 and all("c@8x" in w for w in warnings)  # a/b within 5%; c is 9-11% smaller
    write_report(str(path), str(tmp_path / "out"))
    md = (tmp_path / "out" / "report.md").read_text()
    assert "differ by more than 5% in measured bytes" in md and "| a@8x | c@8x |" in md


def test_a_one_item_difference_gets_no_star(tmp_path):
    """One item that the plan fails and full answers gives the interval [-1, -1]: it excludes 0 but cannot show
    a difference (min_units_for_difference), so report.md puts no star on it; twenty such items do get one."""
    roles = {"full": "full", "snapkv@8x": "1d"}
    kv = {"full": 1000, "snapkv@8x": 125}
    one = tmp_path / "one.jsonl"
    _write_results(one, {"full": [1], "snapkv@8x": [0]}, roles, kv)
    write_report(str(one), str(tmp_path / "one"))
    md = (tmp_path / "one" / "report.md").read_text()
    assert "-1.000 [-1.000, -1.000]" in md and "-1.000 [-1.000, -1.000] *" not in md
    many = tmp_path / "many.jsonl"
    _write_results(many, {"full": [1] * 20, "snapkv@8x": [0] * 20}, roles, kv)
    write_report(str(many), str(tmp_path / "many"))
    assert "-1.000 [-1.000, -1.000] *" in (tmp_path / "many" / "report.md").read_text()  # 20 of 20 disagree
    mixed = tmp_path / "mixed.jsonl"
    _write_results(mixed, {"full": [1] * 20, "snapkv@8x": [0] * 12 + [1] * 8}, roles, kv)
    write_report(str(mixed), str(tmp_path / "mixed"))
    assert "-0.600 [" in (md := (tmp_path / "mixed" / "report.md").read_text()) and "] *" in md
