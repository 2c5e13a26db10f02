"""The lm-eval model ``polykv``: the full plan scores exactly as lm-eval's ``hf``; a compressing plan
measurably holds fewer bytes and changes the scores; ``polykv lm-eval`` runs lm-eval's command line."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow  # lm-eval's harness: about 20 s of imports and evaluation

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = ["polykv_tiny_gen", "polykv_tiny_choice"]


def _evaluate(lm, tasks_folder):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=TASKS,
                                   task_manager=TaskManager(include_path=tasks_folder, include_defaults=False),
                                   log_samples=True, bootstrap_iters=0)


def _responses(results, task):
    """doc id -> the model's raw responses (generated text, or (loglikelihood, is_greedy) per choice)."""
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


@pytest.fixture(scope="module")
def hf_results(tiny_hf_folder, lm_eval_tasks):
    from lm_eval.models.huggingface import HFLM

    return _evaluate(HFLM(pretrained=tiny_hf_folder, device="cpu", batch_size=1), lm_eval_tasks)


def test_full_plan_scores_exactly_as_lm_eval_hf(tiny_hf_folder, lm_eval_tasks, hf_results):
    from polykv.integrations.lm_harness import PolykvLM

    lm = PolykvLM(pretrained=tiny_hf_folder, plan="full")
    ours = _evaluate(lm, lm_eval_tasks)
    assert _responses(ours, "polykv_tiny_gen") == _responses(hf_results, "polykv_tiny_gen")
    assert any(text for texts in _responses(ours, "polykv_tiny_gen").values() for text in texts)
    theirs = _responses(hf_results, "polykv_tiny_choice")
    for doc, choices in _responses(ours, "polykv_tiny_choice").items():
        for (ll, greedy), (ll_hf, greedy_hf) in zip(choices, theirs[doc], strict=True):
            assert ll == pytest.approx(ll_hf, rel=1e-5, abs=1e-4) and greedy == greedy_hf
    for task in TASKS:
        assert ours["results"][task] == hf_results["results"][task]
    kv = ours["config"]["polykv"]["requests"]
    assert kv["generate_until"]["count"] == 4 and kv["loglikelihood"]["count"] == 12
    for r in kv.values():  # the full cache (float32 here): measured bytes are exactly a full cache's
        assert r["mean_kv_bytes"] == r["mean_full_kv_bytes"] and r["full_over_measured"] == 1.0


def test_a_compressing_plan_holds_fewer_bytes_and_moves_the_scores(tiny_hf_folder, lm_eval_tasks, hf_results,
                                                                   tmp_path):
    from polykv.models.geometry import geometry_of_model
    from polykv.integrations.lm_harness import PolykvLM
    from polykv.plan import uniform_plan

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_folder)
    plan_path = str(tmp_path / "h2o.plan.json")
    uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=24, k_bits=8,
                 v_bits=4, decode_slack=2).save(plan_path)
    small = PolykvLM(pretrained=tiny_hf_folder, plan=plan_path)
    ours = _evaluate(small, lm_eval_tasks)
    kv = ours["config"]["polykv"]["requests"]
    for r in kv.values():
        assert r["mean_context_tokens"] > 100 and r["full_over_measured"] > 4
    lls = [ll for c in _responses(ours, "polykv_tiny_choice").values() for ll, _ in c]
    lls_hf = [ll for c in _responses(hf_results, "polykv_tiny_choice").values() for ll, _ in c]
    assert max(abs(a - b) for a, b in zip(lls, lls_hf)) > 1e-3


def test_polykv_lm_eval_command(tiny_hf_folder, lm_eval_tasks, tmp_path, capsys):
    from polykv.cli import main

    out = tmp_path / "out"
    assert main(["lm-eval", "--model", "polykv", "--model_args", f"pretrained={tiny_hf_folder},plan=full",
                 "--tasks", ",".join(TASKS), "--include_path", lm_eval_tasks, "--output_path", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "polykv_tiny_choice" in printed and "| loglikelihood | 12 |" in printed
    [written] = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f.startswith("results")]
    with open(written) as fh:
        assert json.load(fh)["config"]["polykv"]["requests"]["generate_until"]["count"] == 4


def test_rolling_loglikelihood_matches_hf_under_the_full_plan(tiny_hf_folder):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from polykv.integrations.lm_harness import PolykvLM

    texts = ["amber falcon garden harbor kettle meadow rocket violin walnut zipper " * 3, "a short line."]
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
                for i, t in enumerate(texts)]
    hf = HFLM(pretrained=tiny_hf_folder, device="cpu", batch_size=1, max_length=64)
    ours = PolykvLM(pretrained=tiny_hf_folder, plan="full", max_length=64)  # windows of 64 tokens
    theirs, mine = hf.loglikelihood_rolling(requests), ours.loglikelihood_rolling(requests)
    assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-4)
    assert len(ours.requests) > len(texts)  # the long text was scored in several windows
