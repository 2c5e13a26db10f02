"""``generate_until`` with ``polykv_question_marker``: the prompt's context is compressed, the question fed after it
through the compressed cache, as ``polykv.answer`` does; without the key the whole prompt is the context."""

from __future__ import annotations

import os

import pytest

import polykv
from polykv.errors import PolykvError

pytestmark = pytest.mark.slow  # lm-eval's imports

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONTEXT = "amber falcon garden harbor kettle meadow rocket violin walnut zipper. " * 3
QUESTIONS = ["\nQuestion: which word comes first?\nAnswer:", "\nQuestion: and the last?\nAnswer:"]
GEN = {"until": ["@@"], "max_gen_toks": 8, "do_sample": False}


def _requests(**extra):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, arguments=(CONTEXT + q, dict(GEN, **extra)), idx=i)
            for i, q in enumerate(QUESTIONS)]


def _plan(model):
    from polykv.models.geometry import geometry_of_model

    return polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=24, decode_slack=4)


def test_the_question_is_fed_after_the_compressed_context(tiny_hf_folder):
    from polykv.integrations.lm_harness import PolykvLM

    probe = PolykvLM(pretrained=tiny_hf_folder, plan="full")
    plan = _plan(probe.model)
    lm = PolykvLM(pretrained=tiny_hf_folder, plan=plan)
    got = lm.generate_until(_requests(polykv_question_marker="\nQuestion:"))
    api = polykv.answer(lm.model, plan, lm.tokenizer, context=CONTEXT, questions=QUESTIONS, max_new_tokens=8)
    assert got == api.texts and any(got)
    whole = len(lm.tokenizer(CONTEXT + QUESTIONS[0]).input_ids)
    assert [r["context_tokens"] for r in lm.requests] == [api.context_tokens] * 2 and api.context_tokens < whole
    assert [r["kv_bytes"] for r in lm.requests] == [api.context_bytes.total] * 2


def test_under_the_full_plan_the_split_generates_what_the_whole_prompt_does(tiny_hf_folder):
    from polykv.integrations.lm_harness import PolykvLM

    lm = PolykvLM(pretrained=tiny_hf_folder, plan="full")
    assert lm.generate_until(_requests(polykv_question_marker="\nQuestion:")) == lm.generate_until(_requests())
    split, whole = lm.requests[:2], lm.requests[2:]
    assert all(s["context_tokens"] < w["context_tokens"] for s, w in zip(split, whole))


@pytest.mark.parametrize("marker,match", [("\nNo such line:", "not in the prompt"), ("", "non-empty text"),
                                          (CONTEXT, "leaves no context")])
def test_a_marker_that_cannot_split_the_prompt_is_refused_in_one_line(tiny_hf_folder, marker, match):
    from polykv.integrations.lm_harness import PolykvLM

    lm = PolykvLM(pretrained=tiny_hf_folder, plan="full")
    with pytest.raises(PolykvError, match=match) as err:
        lm.generate_until(_requests(polykv_question_marker=marker))
    assert "\n" not in str(err.value).replace(repr(marker), "") and lm.requests == []
