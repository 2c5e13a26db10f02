"""The pipeline task ``polykv-text-generation``: the context compressed once, each question fed after it, exactly
``polykv.answer``."""

from __future__ import annotations

import pytest
import transformers

import polykv
import polykv.integrations.pipeline  # noqa: F401 (registers the task)
from polykv.errors import PolykvError
from polykv.models.geometry import geometry_of_model

CONTEXT = "The word to repeat is amber; garden kettle meadow rocket violin walnut zipper harbor. " * 3
QUESTIONS = [" Repeat it:", " Which word?"]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_hf_folder):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_folder)
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_folder).eval(), tok


def _plan(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=24,
                               decode_slack=4)


def test_the_pipeline_answers_as_the_api(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    plan = _plan(model)
    pipe = transformers.pipeline("polykv-text-generation", model=model, tokenizer=tok, plan=plan, max_new_tokens=8)
    api = polykv.answer(model, plan, tok, context=CONTEXT, questions=QUESTIONS, max_new_tokens=8)
    assert pipe(CONTEXT, questions=QUESTIONS) == {"answers": api.texts}
    assert pipe(CONTEXT, question=QUESTIONS[1]) == {"answer": api.texts[1]}
    path = tmp_path / "p.json"
    plan.save(str(path))
    got = pipe(CONTEXT, question=QUESTIONS[0], plan=str(path), return_bytes=True)
    assert got == {"answer": api.texts[0], "context_bytes": api.context_bytes.total,
                   "end_bytes": [api.end_bytes[0].total]}
    assert model.config._attn_implementation == "sdpa"                     # the model is plain again after a call


@pytest.mark.parametrize("call,match", [
    (lambda pipe: pipe(CONTEXT, question=QUESTIONS[0]), "no plan: pass plan="),
    (lambda pipe: pipe(CONTEXT, plan="full.json"), "full.json"),
    (lambda pipe: pipe(CONTEXT, plan=3), "plan must be a polykv Plan"),
    (lambda pipe: pipe(CONTEXT, question="x", questions=["y"], plan=None), "not both"),
    (lambda pipe: pipe(CONTEXT, question=["x"]), "question must be a string"),
    (lambda pipe: pipe(CONTEXT, temperature=0.7), "unknown argument"),
    (lambda pipe: pipe("", question="x"), "non-empty string"),
    (lambda pipe: pipe(CONTEXT, plan=polykv.full_plan(geometry_of_model(pipe.model))), "no question"),
    (lambda pipe: pipe(CONTEXT, questions=[], plan=polykv.full_plan(geometry_of_model(pipe.model))), "questions="),
])
def test_bad_pipeline_calls_are_refused_in_one_line(model_and_tokenizer, call, match):
    model, tok = model_and_tokenizer
    pipe = transformers.pipeline("polykv-text-generation", model=model, tokenizer=tok)
    with pytest.raises(PolykvError, match=match) as err:
        call(pipe)
    assert "\n" not in str(err.value)
