"""Report figures for papers: SVG and PDF beside PNG, at a chosen resolution, drawn as the data says."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import attrs
import numpy as np
import pytest

import polykv
from polykv.cli import main
from polykv.memory import kept_tokens, memory_report, predict_resident
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec, Provenance
from polykv.plan.writing import plan_dict
from polykv.studies.figures import Figures
from polykv.studies.plots import is_report_figure
from polykv.studies.results import FORMAT, Results
from polykv.studies.routes import route_rows
from polykv.testing import tiny_model

from tests.studies.runner.conftest import TINY
from tests.studies.runner.test_report_conclusion import write_results


def _svg_texts(path) -> list[str]:
    """The texts of an SVG figure (matplotlib draws each as paths after a comment holding its text)."""
    data = open(path, encoding="utf-8").read()
    ET.fromstring(data.encode())  # well formed
    return [t.strip() for t in re.findall(r"<!-- (.*?) -->", data)]


def test_report_writes_svg_and_pdf_at_the_asked_resolution(tmp_path, small_study):
    _, results, _ = small_study
    out = tmp_path / "rep"
    assert main(["report", results, "-o", str(out), "--format", "svg,pdf", "--dpi", "60"]) == 0
    names = sorted(p.name for p in out.iterdir())
    stems = ["passkey-score-vs-memory", "routes-4x", "sensitivity"]
    assert names == sorted([f"{s}.{e}" for s in stems for e in ("svg", "pdf")] + ["report.md"])
    md = (out / "report.md").read_text()
    for stem in stems:
        assert f"]({stem}.svg)" in md
        root = ET.parse(out / f"{stem}.svg").getroot()
        assert root.tag.endswith("svg")
        pdf = (out / f"{stem}.pdf").read_bytes()
        assert pdf.startswith(b"%PDF-1.") and pdf.rstrip().endswith(b"%%EOF") and b"trailer" in pdf
        assert is_report_figure(str(out / f"{stem}.svg")) and is_report_figure(str(out / f"{stem}.pdf"))
    assert main(["report", results, "-o", str(out), "--format", "svg,pdf"]) == 0  # its own figures: replaced


def test_dpi_sets_the_png_resolution(tmp_path, small_study):
    _, results, _ = small_study
    sizes = {}
    for dpi in (50, 100):
        out = tmp_path / f"d{dpi}"
        assert main(["report", results, "-o", str(out), "--dpi", str(dpi)]) == 0
        data = (out / "sensitivity.png").read_bytes()
        sizes[dpi] = int.from_bytes(data[16:20], "big")  # IHDR width
    assert sizes[100] == pytest.approx(2 * sizes[50], abs=2)


def test_a_foreign_file_where_a_figure_goes_is_refused_before_anything_is_written(tmp_path, small_study, capsys):
    _, results, _ = small_study
    out = tmp_path / "rep"
    out.mkdir()
    (out / "sensitivity.pdf").write_bytes(b"%PDF-1.4 someone else's paper\n%%EOF\n")
    assert main(["report", results, "-o", str(out), "--format", "pdf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polykv report: error: ") and "sensitivity.pdf" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["sensitivity.pdf"]


def test_figures_reserve_one_file_per_format_and_embed_the_png():
    fig = Figures("out", ("pdf", "png"), 72)
    assert fig.add("a/../b", lambda p: p) == "a_.._b.png"
    assert [p for p, _ in fig.pending] == ["out/a_.._b.pdf", "out/a_.._b.png"]
    assert fig.add("a/../b", lambda p: p) == "a_.._b-2.png"


def test_score_vs_memory_marks_budgets_plainly_and_draws_one_line_per_plan(tmp_path):
    scores = {"full": [1.0] * 4, "route@8x": [1.0, 0, 1, 0], "route@4x": [1.0] * 4,
              "kvzip@8x": [0.0, 1, 1, 1], "kvzip@4x": [1.0] * 4}
    geo = geometry_of_model(tiny_model(**TINY))
    extra = {n: {"budget": None, "method": n, "plan": plan_dict(polykv.uniform_plan(
        geo, prefill=OpSpec(rule="snapkv", capacity_ratio=1 / float(n[-2])),
        provenance=Provenance(solver="hand", budget={"ratio": float(n[-2])})))} for n in ("kvzip@8x", "kvzip@4x")}
    path = write_results(tmp_path / "r.jsonl", scores, policy_extra=extra)
    assert main(["report", path, "-o", str(tmp_path / "rep"), "--format", "svg"]) == 0
    texts = _svg_texts(tmp_path / "rep" / "passkey-score-vs-memory.svg")
    assert texts.count("kvzip") == 1 and texts.count("route") == 1  # one legend entry per plan
    assert "8x" in texts and "4x" in texts  # the budgets' ticks
    assert not [t for t in texts if "^" in t or "mathdefault" in t]  # no 6x10^0 tick labels


def _allocator_study():
    """An allocator plan file over the tiny model's 4 layers, listed as ``alloc@8x`` (as the demo lists its
    kvzip-global plans), solved for 400 tokens and run on 100."""
    geo = geometry_of_model(tiny_model(**TINY))
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity_ratio=0.5), decode_slack=1)
    plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="pyramidkv", layers=tuple(range(4))),),
                        provenance=Provenance(solver="hand", context_tokens=400, budget={"ratio": 8.0}))
    T = 100
    planned = [kept_tokens(lp, T) for lp in plan.layers]
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "x",
              "spec": {"name": "alloc", "context_tokens": T, "storage_dtype": "bfloat16"}},
             {"kind": "policy", "policy": "alloc@8x", "method": "alloc@8x", "budget": None, "role": "",
              "plan": plan_dict(plan), "predicted_held_bytes_16bit": 1000, "full_bytes_16bit": 8000}]
    return lines, plan, geo, T, planned


def test_allocator_plans_show_what_they_kept_and_their_expected_ratio(tmp_path):
    lines, plan, geo, T, planned = _allocator_study()
    at_plan = predict_resident(plan, geo, T, dtype_bytes=2,
                               allocations={i: {"budget": planned[i]} for i in range(4)})
    # the allocator kept a quarter of the planned tokens on layer 0 and all of them elsewhere
    measured = [int(at_plan[0].resident_bytes / 4)] + [r.resident_bytes for r in at_plan[1:]]
    for i in range(3):
        lines.append({"kind": "result", "policy": "alloc@8x", "task": "passkey", "item": f"passkey-{i}",
                      "score": 1.0, "kv_bytes": sum(measured), "kv_bytes_per_layer": measured,
                      "full_kv_bytes": 8000, "context_tokens": T})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, _ = route_rows(Results.load(str(path)), "8x")
    kept = [lay["kept"] for lay in rows[0]["layers"]]
    assert kept[0] == pytest.approx(planned[0] / 4, rel=0.02) and kept[1:] == pytest.approx(planned[1:])
    assert main(["report", str(path), "-o", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    expected = memory_report(plan, geo, T).expected_ratio
    assert f"| bound 8.00x, expected {expected:.2f}x |" in md
    assert "`alloc@8x`: solved for a 400-token context (its provenance budget), run on 100 tokens" in md


def test_route_panels_have_a_scale(tmp_path, small_study):
    _, results, _ = small_study
    assert main(["report", results, "-o", str(tmp_path / "rep"), "--format", "svg"]) == 0
    texts = _svg_texts(tmp_path / "rep" / "routes-4x.svg")
    assert texts.count("T/2") == len(Results.load(results).policies) - 1  # every panel (the full cache has none)
    assert np.all([t in texts for t in ("0", "T")])
