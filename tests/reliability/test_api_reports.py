"""Bad input to the report's figure, ranking and pricing API: polykv's own error, one line naming the parameter,
nothing written."""

from __future__ import annotations

import json

import pytest

from polykv.errors import PolykvError, ProfileError, SolverError, StudyError
from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers.pricing import price_config
from polykv.studies import designs
from polykv.studies.figures import Figures
from polykv.studies.options import check_dpi, parse_formats
from polykv.studies.report import write_report
from polykv.studies.results import FORMAT, Results

import numpy as np


@pytest.fixture
def results(tmp_path):
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "x", "spec": {"name": "t",
                                                                                         "context_tokens": 100}},
             {"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full"},
             {"kind": "policy", "policy": "a@8x", "method": "a", "budget": "8x", "role": ""}]
    for i in range(3):
        for name in ("full", "a@8x"):
            lines.append({"kind": "result", "policy": name, "task": "passkey", "item": f"passkey-{i}", "score": 1.0,
                          "kv_bytes": 100, "full_kv_bytes": 800, "context_tokens": 100})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _one_line(err, *words):
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("kw, words", [
    ({"formats": ["gif"]}, ("'gif'", "png, svg, pdf")),
    ({"formats": "svg,jpeg"}, ("'jpeg'",)),
    ({"formats": []}, ("--format", "(none)")),
    ({"dpi": 0}, ("--dpi", "between 10 and 2400")),
    ({"dpi": 72.5}, ("--dpi",)),
    ({"dpi": True}, ("--dpi",)),
    ({"placement_metric": "auc"}, ("placement metric 'auc'", "top-1, kl")),
])
def test_write_report_refuses_bad_options_before_writing(results, tmp_path, kw, words):
    with pytest.raises(StudyError) as err:
        write_report(results, str(tmp_path / "rep"), **kw)
    _one_line(err, *words)
    assert not (tmp_path / "rep").exists()


def test_the_figure_helpers_refuse_the_same(tmp_path):
    for call, word in ((lambda: parse_formats("tiff"), "'tiff'"), (lambda: check_dpi(5), "--dpi 5"),
                       (lambda: Figures(str(tmp_path), ("bmp",)), "'bmp'")):
        with pytest.raises(StudyError) as err:
            call()
        _one_line(err, word)


def test_placement_refuses_an_unknown_metric(results):
    with pytest.raises(StudyError) as err:
        designs.placement(Results.load(results), "passkey", "8x", metric="accuracy")
    _one_line(err, "'accuracy'", "top-1, kl")


@pytest.fixture(scope="module")
def profile():
    return Profile.from_table(np.random.default_rng(0).random((4, 54)), moend_configs("tova"), (4, 2, 64))


@pytest.mark.parametrize("layer, budget, kw, cls, words", [
    (4, 1024, {}, SolverError, ("layer 4", "layers 0 to 3")),
    (-1, 1024, {}, SolverError, ("layer -1",)),
    (0, "8x", {}, SolverError, ("budget '8x'", "Budget.parse")),
    (0, 0, {}, SolverError, ("context length",)),
    (0, 1024, {"metric": "nope"}, ProfileError, ("nope",)),
])
def test_price_config_refuses_bad_arguments(profile, layer, budget, kw, cls, words):
    cfg = CandidateConfig(rule="tova", keep=0.3, k_bits=8, v_bits=8)
    with pytest.raises(cls) as err:
        price_config(profile, layer, cfg, budget=budget, **kw)
    assert isinstance(err.value, PolykvError)
    _one_line(err, *words)


def test_price_config_takes_a_budget_or_a_context_length(profile):
    cfg = CandidateConfig(rule="tova", keep=0.3, k_bits=8, v_bits=8)
    nominal = price_config(profile, 0, cfg, budget=1024)
    assert nominal == price_config(profile, 0, cfg, budget=Budget.parse("8x", 1024))
