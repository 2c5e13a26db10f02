"""``polykv calibrate`` end to end on a local model folder (tiny Llama + a BPE tokenizer trained here)."""

from __future__ import annotations

import json
import os

import pytest

from polykv.cli import main
from polykv.profiling.profile import load_profile
from polykv.adapters.rules.query_stats import QueryStats


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
    assert "no such folder" in capsys.readouterr().err
    assert main(["calibrate", model_dir, "-o", out, "--tokens", "64", "--prefix", "64"]) == 2
    assert "must exceed --prefix" in capsys.readouterr().err


def test_extend_adds_rules_equal_to_calibrating_them_together(model_dir, tmp_path, capsys):
    common = ["--sequences", "2", "--tokens", "96", "--prefix", "64", "--keeps", "0.5,1.0", "--bits", "16,4",
              "--stat-capacity", "16", "--no-progress"]
    both, base = str(tmp_path / "both.profile.json"), str(tmp_path / "base.profile.json")
    assert main(["calibrate", model_dir, "-o", both, "--rules", "tova,triattention,keydiff", *common]) == 0
    assert main(["calibrate", model_dir, "-o", base, "--rules", "tova,triattention", *common]) == 0
    merged = str(tmp_path / "merged.profile.json")
    assert main(["calibrate", model_dir, "-o", merged, "--rules", "keydiff", "--extend", base, *common]) == 0, \
        capsys.readouterr().err
    a, b = load_profile(both), load_profile(merged)
    label = {c.label: i for i, c in enumerate(a.configs)}
    assert sorted(label) == sorted(c.label for c in b.configs)
    cols = [label[c.label] for c in b.configs]
    assert (a.table("l2")[:, cols] == b.table("l2")).all()
    assert list(b.stats["cosine"].columns) == ["tova", "triattention", "keydiff"]
    assert "rules keydiff added" in b.provenance.note
    assert b.provenance.extends == (load_profile(base).fingerprint,)  # written and read back
    assert "extends" not in json.load(open(both))["provenance"]      # only an extended profile carries it
    assert os.path.isfile(str(tmp_path / "merged.qstats.safetensors"))  # the base's triattention data came along


def test_extend_refuses_another_calibration_before_measuring(model_dir, tmp_path, capsys):
    base = str(tmp_path / "base.profile.json")
    common = ["--tokens", "96", "--prefix", "64", "--keeps", "0.5,1.0", "--bits", "16", "--stat-capacity", "16",
              "--no-progress"]
    assert main(["calibrate", model_dir, "-o", base, "--sequences", "2", "--rules", "tova", *common]) == 0
    capsys.readouterr()
    out = str(tmp_path / "x.profile.json")
    assert main(["calibrate", model_dir, "-o", out, "--sequences", "3", "--rules", "h2o", "--extend", base,
                 *common]) == 2
    err = capsys.readouterr().err
    assert "--extend" in err and "pass the base profile's --sequences" in err and not os.path.exists(out)
    assert main(["calibrate", model_dir, "-o", out, "--sequences", "2", "--rules", "tova", "--extend", base,
                 *common, "--quantizer-param", "group_size=16"]) == 2
    assert "quantizer_params" in capsys.readouterr().err and not os.path.exists(out)
