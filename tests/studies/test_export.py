"""CSV exports: policies.csv carries report.md's own numbers, items.csv every result; names and predictions with
commas, quotes and newlines survive a round trip through the csv module; an export never replaces a user's file."""

import csv
import io
import json

import pytest

from polykv.cli import main
from polykv.errors import OutputError
from polykv.profiling import stats
from polykv.studies import designs
from polykv.studies.combine import combine_results
from polykv.studies.export import ITEM_COLUMNS, POLICY_COLUMNS, csv_texts, write_csv
from polykv.studies.report import policy_rows

ODD = 'snap,kv "4x"'


def results_file(path, n=8):
    recs = [{"format": "polykv-study-results", "kind": "header", "spec": {"name": "x", "context_tokens": 256},
             "spec_hash": "spec-0", "version": 1}]
    for name in ("full", ODD):
        recs.append({"kind": "policy", "policy": name, "method": name.split(",")[0], "budget": None if name == "full"
                     else "4x", "role": "full" if name == "full" else None, "plan": None})
    for i in range(n):
        for name, score, kv in (("full", 1.0, 4000), (ODD, float(i % 2), 1000)):
            recs.append({"kind": "result", "policy": name, "task": "jsonl_file", "item": f"line-{i + 1}",
                         "score": score, "kv_bytes": kv, "metadata_bytes": 24, "full_kv_bytes": 4000,
                         "context_tokens": 256, "generated": f' room {i},\n"then" more', "answers": [f"room {i}"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def read(text):
    return list(csv.DictReader(io.StringIO(text)))


def test_policies_csv_has_the_reports_numbers(tmp_path):
    path = results_file(tmp_path / "r.jsonl")
    texts = csv_texts(path)
    rows = read(texts["policies.csv"])
    assert list(rows[0]) == list(POLICY_COLUMNS) and [r["policy"] for r in rows] == ["full", ODD]
    res = combine_results([path])
    want = {r["policy"]: r for r in policy_rows(res, "jsonl_file")}
    full, odd = rows
    assert int(odd["n_items"]) == 8 and float(odd["mean_score"]) == want[ODD]["mean"] == 0.5
    wilson = stats.wilson_interval(4, 8)
    assert (float(odd["accuracy_low"]), float(odd["accuracy_high"])) == (wilson.low, wilson.high)
    assert float(odd["held_bytes"]) == 1024 and float(odd["ratio_vs_full16"]) == want[ODD]["ratio"]
    diff = designs.paired_vs(res, "jsonl_file", ODD, "full")
    assert (float(odd["diff_vs_full"]), float(odd["diff_low"]), float(odd["diff_high"])) == \
        (diff.estimate, diff.low, diff.high)
    assert full["diff_vs_full"] == "" and full["budget"] == "" and odd["budget"] == "4x"


def test_items_csv_round_trips_names_and_predictions(tmp_path):
    rows = read(csv_texts(results_file(tmp_path / "r.jsonl"))["items.csv"])
    assert list(rows[0]) == list(ITEM_COLUMNS) and len(rows) == 16
    odd = [r for r in rows if r["policy"] == ODD]
    assert odd[3]["prediction"] == ' room 3,\n"then" more' and odd[3]["item"] == "line-4"
    assert odd[3]["score"] == "1.0" and odd[3]["kv_bytes"] == "1000" and odd[3]["metadata_bytes"] == "24"


def test_report_csv_writes_both_files_beside_report_md_and_rewrites_its_own(tmp_path, capsys):
    path = results_file(tmp_path / "r.jsonl")
    out = tmp_path / "rep"
    assert main(["report", path, "-o", str(out), "--csv"]) == 0
    assert {"report.md", "policies.csv", "items.csv"} <= {p.name for p in out.iterdir()}
    assert "wrote " + str(out / "policies.csv") in capsys.readouterr().out
    assert main(["report", path, "-o", str(out), "--csv"]) == 0          # an earlier export is replaced
    assert len(read((out / "items.csv").read_text())) == 16


def test_an_export_never_replaces_a_users_file_and_writes_nothing_then(tmp_path):
    path = results_file(tmp_path / "r.jsonl")
    out = tmp_path / "rep"
    out.mkdir()
    (out / "items.csv").write_text("my,sheet\n")
    with pytest.raises(OutputError, match="items.csv"):
        write_csv(path, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["items.csv"] and (out / "items.csv").read_text() == "my,sheet\n"
