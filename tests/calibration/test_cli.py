"""``polykv calibrate`` end to end on a local model folder (tiny Llama + a BPE tokenizer trained here)."""

from __future__ import annotations

import json
import os

import pytest

from polykv.cli import main
from polykv.profiling.profile import load_profile
from polykv.models.query_stats import QueryStats


@pytest.fixture(scope="module")
def model_dir(saved_tiny_model):
    return saved_tiny_model(32)


def test_calibrate_then_solve(model_dir, tmp_path, capsys):
    out = str(tmp_path / "tiny.profile.json")
    rc = main(["calibrate", model_dir, "-o", out, "--sequences", "2", "--tokens", "96", "--prefix", "64",
               "--rules", "tova,triattention", "--keeps", "0.5,1.0", "--stat-capacity", "16", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert not os.path.exists(out + ".partial")
    prof = load_profile(out)
    assert prof.table("l2").shape == (2, 9 + 2 * 9)
    assert "stdlib" in prof.provenance.corpus and prof.provenance.seed == 0
    assert QueryStats.load(str(tmp_path / "tiny.qstats.safetensors")).num_layers == 2
    plan = str(tmp_path / "plan.json")
    assert main(["solve", out, "--budget", "4x", "--context", "512", "-o", plan]) == 0, capsys.readouterr().err
    assert json.load(open(plan))["provenance"]["profile_fingerprint"] == prof.fingerprint


def test_clear_errors(model_dir, tmp_path, capsys):
    out = str(tmp_path / "x.profile.json")
    assert main(["calibrate", str(tmp_path / "missing"), "-o", out]) == 2
    assert "not 'default' and not a local folder" in capsys.readouterr().err
    assert main(["calibrate", model_dir, "-o", out, "--tokens", "64", "--prefix", "64"]) == 2
    assert "must exceed --prefix" in capsys.readouterr().err
