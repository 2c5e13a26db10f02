"""The "your own data" example of docs/studies-guide.md runs as written: the spec shipped in examples/ (shown
verbatim in the guide) compares the full cache with three uniform plans on a 10-item JSONL of the user's own
data and exports CSV files; here on the tiny random model, whose answers are noise but whose rows are real."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from polykv.cli import main
from polykv.models.geometry import geometry_of_model
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.testing import tiny_model
from tests.studies.runner.conftest import TINY

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "examples" / "my_data_study.json"
ITEMS = ROOT / "examples" / "my_data" / "items.jsonl"
GUIDE = ROOT / "docs" / "studies-guide.md"


def test_the_guide_shows_the_shipped_spec_and_it_is_short():
    text = SPEC.read_text()
    assert text.strip() in GUIDE.read_text()
    assert len(text.strip().splitlines()) <= 10
    lines = [json.loads(x) for x in ITEMS.read_text().splitlines()]
    assert len(lines) == 10 and all({"context", "question", "answers"} <= set(x) for x in lines)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A profile of the tiny model with the example's three rules (made-up losses, falling with the keep)."""
    configs = [CandidateConfig(rule="full", keep=1.0, k_bits=16, v_bits=16)]
    for rule in ("snapkv", "streamingllm", "h2o"):
        configs += moend_configs(rule, "prefill", keeps=(0.25, 0.5), k_bits=(16,), v_bits=(16,))
    base = np.array([1 - c.keep for c in configs])
    geo = geometry_of_model(tiny_model(**TINY))
    path = tmp_path_factory.mktemp("profile") / "tiny-three-rules.json"
    Profile.from_table(np.stack([base] * geo.num_layers), configs, geo).save(str(path))
    return path


def test_the_example_runs_on_a_tiny_model_and_writes_its_csv_files(tmp_path, profile_path):
    spec = json.loads(SPEC.read_text())
    spec.update(model={"tiny": TINY}, profile=str(profile_path))
    spec["tasks"][0]["params"]["path"] = str(ITEMS)
    path = tmp_path / "my_data_study.json"
    path.write_text(json.dumps(spec))
    results, out = tmp_path / "r.jsonl", tmp_path / "report"
    assert main(["study", str(path), "--results", str(results)]) == 0
    assert main(["report", str(results), "-o", str(out), "--csv"]) == 0
    with open(out / "policies.csv", newline="") as fh:
        policies = list(csv.DictReader(fh))
    assert [p["policy"] for p in policies] == ["full", "snapkv@2x", "streamingllm@2x", "h2o@2x"]
    assert all(p["task"] == "jsonl_file" and p["n_items"] == "10" for p in policies)
    assert all(0.0 <= float(p["mean_score"]) <= 1.0 and float(p["held_bytes"]) > 0 for p in policies)
    assert policies[0]["diff_vs_full"] == "" and all(p["diff_vs_full"] != "" for p in policies[1:])
    assert all(float(p["ratio_vs_full16"]) > 1.0 for p in policies[1:])     # the plans hold less than full
    with open(out / "items.csv", newline="") as fh:
        items = list(csv.DictReader(fh))
    assert len(items) == 40 and {i["item"] for i in items} == {f"line-{n}" for n in range(1, 11)}
    assert all(i["prediction"] is not None and i["score"] in ("0.0", "1.0") for i in items)
