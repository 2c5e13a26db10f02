"""Continuation fidelity in the study runner: KL / top-1 / perplexity against the full cache.

The reference numbers are recomputed here without the runner: the full cache is a plain transformers
DynamicCache, the policy runs through ``polykv.apply`` with its own prefill (no snapshot), and KL and
perplexity come from torch's ``kl_div`` and ``cross_entropy``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import polykv
from polykv.errors import StudyError
from polykv.models.geometry import geometry_of_model
from polykv.plan import full_plan, uniform_plan
from polykv.studies.report import fidelity_rows, write_report
from polykv.studies.results import Results, read_records
from polykv.studies.runner import CharTokenizer, prepare, run_study
from polykv.studies.spec import load_spec
from polykv.studies.tasks.continuation import ContinuationTask
from polykv.testing import tiny_model

TINY = {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 128, "seed": 0}
TASK = {"task": "continuation", "params": {"context_tokens": 160, "continuation_tokens": 48}, "samples": 2,
        "seed": 0}
CAPACITY, SLACK = 24, 4


def _write(folder, **overrides) -> str:
    geo = geometry_of_model(tiny_model(**TINY))
    uniform_plan(geo, prefill="snapkv", decode="tova", capacity=CAPACITY, decode_slack=SLACK).save(
        str(folder / "snap.json"))
    full_plan(geo).save(str(folder / "copy.json"))
    spec = {"name": "cont", "model": {"tiny": TINY}, "context_tokens": 160,
            "plans": {"snap": "snap.json", "copy": "copy.json"}, "tasks": [TASK], **overrides}
    (folder / "spec.json").write_text(json.dumps(spec))
    return str(folder / "spec.json")


def _results(records) -> dict:
    return {(r["policy"], r["item"]): r for r in records if r["kind"] == "result"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cont")
    spec = _write(folder)
    results = str(folder / "results.jsonl")
    counts = run_study(prepare(load_spec(spec), results), progress=False)
    return folder, spec, results, read_records(results), counts


def test_full_cache_scores_itself_perfectly_and_compression_moves_the_distribution(study):
    _, _, _, records, counts = study
    assert counts == {"run": 6, "skipped": 0}
    res = _results(records)
    for item in ("continuation-0", "continuation-1"):
        full, copy, snap = res["full", item], res["copy", item], res["snap", item]
        assert full["kl"] == 0 and full["top1"] == 1 and full["ppl"] == full["ppl_full"]
        assert full["score"] == full["top1"] and snap["score"] == snap["top1"]
        # A full plan run as an ordinary policy is compared like any other: it matches the reference.
        assert copy["kl"] < 1e-6 and copy["top1"] == 1 and copy["ppl"] == pytest.approx(full["ppl"], rel=1e-5)
        assert snap["kl"] > 1e-4 and snap["kl_max"] >= snap["kl"] and snap["ppl_full"] == full["ppl"]
        assert snap["positions"] == full["positions"] == snap["continuation_tokens"] - 1 >= 30
        assert snap["kv_bytes"] < full["kv_bytes"]
        # The decode rule evicted during the continuation: storage stayed within capacity + slack.
        assert snap["kv_bytes_end"] <= snap["kv_bytes"] * (CAPACITY + SLACK) / CAPACITY
        assert full["kv_bytes_end"] > full["kv_bytes"]


def _direct(item, plan, model, tokenizer) -> dict:
    """KL(full || plan), top-1 agreement and both perplexities, computed without the runner."""
    ctx = torch.tensor([tokenizer.encode(item.context)])
    cont = torch.tensor([tokenizer.encode(item.answers[0])])
    with torch.no_grad():
        ref_cache = DynamicCache()
        model(ctx, cache=ref_cache, use_cache=True)
        ref = torch.cat([model(cont[:, i:i + 1], cache=ref_cache, use_cache=True).logits[0]
                         for i in range(cont.shape[1] - 1)])                      # (m, V)
        with polykv.apply(model, plan) as session:
            session.prefill(ctx)
            pol = torch.cat([model(cont[:, i:i + 1], cache=session.cache, use_cache=True).logits[0]
                             for i in range(cont.shape[1] - 1)])                  # (m, V)
    ref_lp, pol_lp = F.log_softmax(ref.double(), -1), F.log_softmax(pol.double(), -1)
    target = cont[0, 1:]
    return {"kl": float(F.kl_div(pol_lp, ref_lp, log_target=True, reduction="sum") / len(target)),
            "top1": float((ref.argmax(-1) == pol.argmax(-1)).double().mean()),
            "ppl": math.exp(float(F.cross_entropy(pol_lp, target))),
            "ppl_full": math.exp(float(F.cross_entropy(ref_lp, target)))}


def test_metrics_equal_a_direct_computation(study):
    folder, _, _, records, _ = study
    res = _results(records)
    model = tiny_model(**TINY)
    tokenizer = CharTokenizer(model.config.vocab_size)
    items = ContinuationTask().make_items(tokenizer, TASK["samples"], TASK["seed"], **TASK["params"])
    from polykv.plan import load_plan

    for item in items:
        for name in ("snap", "copy"):
            want = _direct(item, load_plan(str(folder / f"{name}.json")), model, tokenizer)
            got = res[name, item.id]
            assert got["top1"] == pytest.approx(want["top1"], abs=1e-12)
            assert got["kl"] == pytest.approx(want["kl"], rel=1e-3, abs=1e-6)
            assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-4)
            assert got["ppl_full"] == pytest.approx(want["ppl_full"], rel=1e-4)


class Stop(Exception):
    """Raised from the result callback: the study dies between two results."""


@pytest.mark.parametrize("after", [1, 4])
def test_resume_recomputes_the_reference_and_repeats_nothing(tmp_path, study, after):
    _, _, _, reference, _ = study
    spec = load_spec(_write(tmp_path))
    results = str(tmp_path / "results.jsonl")
    seen = []

    def on_result(record):
        seen.append(record)
        if len(seen) == after:  # after 1: only item 0's full record exists when the run resumes
            raise Stop()

    with pytest.raises(Stop):
        run_study(prepare(spec, results), progress=False, on_result=on_result)
    counts = run_study(prepare(spec, results), progress=False)
    assert counts == {"run": 6 - after, "skipped": after}
    keys = ("kl", "kl_max", "top1", "ppl", "ppl_full", "score", "kv_bytes", "kv_bytes_end", "positions")
    got, want = _results(read_records(results)), _results(reference)
    assert set(got) == set(want)
    for key in want:
        assert {k: got[key][k] for k in keys} == {k: want[key][k] for k in keys}


def test_a_prefill_per_policy_gives_the_same_metrics_as_prefill_reuse(tmp_path, study):
    _, _, _, reference, _ = study
    results = str(tmp_path / "results.jsonl")
    run_study(prepare(load_spec(_write(tmp_path, reuse_prefill=False)), results), progress=False)
    got, want = _results(read_records(results)), _results(reference)
    assert set(got) == set(want)
    for key, rec in want.items():
        assert not got[key]["reused_prefill"] and rec["reused_prefill"]
        for k in ("top1", "positions", "kv_bytes", "kv_bytes_end"):
            assert got[key][k] == rec[k]
        for k in ("kl", "ppl", "ppl_full"):
            assert got[key][k] == pytest.approx(rec[k], rel=1e-5, abs=1e-7)


def test_continuation_without_the_full_baseline_fails_before_the_model_loads(tmp_path):
    path = _write(tmp_path, baseline=False, model={"tiny": {"family": "no-such-family"}})
    with pytest.raises(StudyError, match=r"field 'baseline'.*teacher_forced.*full baseline"):
        run_study(prepare(load_spec(path), str(tmp_path / "r.jsonl")), progress=False)
    assert not (tmp_path / "r.jsonl").exists()


def test_the_report_shows_kl_and_perplexity(tmp_path, study):
    _, _, results, records, _ = study
    rows = {r["policy"]: r for r in fidelity_rows(Results.load(results), "continuation")}
    res = _results(records)
    assert set(rows) == {"full", "snap", "copy"}
    assert rows["snap"]["kl"] == pytest.approx((res["snap", "continuation-0"]["kl"] +
                                                res["snap", "continuation-1"]["kl"]) / 2)
    md = open(write_report(results, str(tmp_path / "report"))[0]).read()
    assert "| policy | budget | items | positions | top-1 agreement | mean KL |" in md
    fidelity = md.split("| policy | budget | items | positions | top-1 agreement | mean KL |")[1]
    line = next(x for x in fidelity.splitlines() if x.startswith("| snap |"))
    assert f"{rows['snap']['kl']:.4f}" in line and f"{rows['snap']['ppl']:.2f}" in line
