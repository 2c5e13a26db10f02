"""Bad input to ``polykv.answer`` (compress a context, then answer questions): one clear line naming the parameter,
before the model runs."""

from __future__ import annotations

import pytest

import polykv
from polykv.errors import PlanError, PolykvError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.studies.runner import CharTokenizer
from polykv.testing import tiny_model

CONTEXT = "The vault code is 417. " * 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def plan(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", decode="full", capacity=16)


TOK = CharTokenizer(128)
CASES = [
    ("no-questions", dict(questions=[]), "questions="),
    ("empty-question", dict(questions=""), "questions="),
    ("empty-question-in-list", dict(questions=["What?", ""]), "questions="),
    ("question-not-text", dict(questions=[3]), "questions="),
    ("questions-a-dict", dict(questions={"q": "What?"}), "questions="),
    ("empty-context", dict(context=""), "context="),
    ("context-not-text", dict(context=["a", "b"]), "context="),
    ("max-new-tokens-zero", dict(max_new_tokens=0), "max_new_tokens="),
    ("max-new-tokens-bool", dict(max_new_tokens=True), "max_new_tokens="),
    ("max-new-tokens-float", dict(max_new_tokens=2.5), "max_new_tokens="),
    ("prompt-format-unknown", dict(prompt_format="xml"), "parameter 'prompt_format'"),
    ("bos-unknown", dict(bos="yes"), "parameter 'bos'"),
    ("bos-true-without-bos", dict(bos=True), "parameter 'bos'"),
    ("chat-without-template", dict(prompt_format="chat"), "chat template"),
    ("tokenizer-a-name", dict(tokenizer="gpt2"), "tokenizer"),
    ("tokenizer-missing", dict(tokenizer=None), "tokenizer"),
    ("chunk-size-zero", dict(chunk_size=0), "chunk_size"),
    ("storage-dtype-int", dict(storage_dtype="int8"), "storage_dtype"),
    ("chunk-size-zero-two-questions", dict(chunk_size=0, questions=["A?", "B?"]), "chunk_size"),
    ("chunk-size-negative-two-questions", dict(chunk_size=-4, questions=["A?", "B?"]), "chunk_size"),
    ("storage-dtype-int-two-questions", dict(storage_dtype="int8", questions=["A?", "B?"]), "storage_dtype"),
    ("seed-negative-two-questions", dict(seed=-1, questions=["A?", "B?"]), "seed"),
]


@pytest.mark.parametrize("case,change,match", CASES, ids=[c[0] for c in CASES])
def test_bad_answer_arguments_are_refused_before_the_model_runs(model, plan, forwards, case, change, match):
    kwargs = dict(context=CONTEXT, questions=" What is the code?", max_new_tokens=4)
    kwargs.update(change)
    tokenizer = kwargs.pop("tokenizer", TOK)
    with pytest.raises(PolykvError, match=match) as err:
        polykv.answer(model, plan, tokenizer, **kwargs)
    assert isinstance(err.value, RuntimeConfigError) and "\n" not in str(err.value)
    assert forwards == []


def test_a_plan_that_is_not_a_plan_or_for_another_model_is_refused(model, forwards):
    with pytest.raises(RuntimeConfigError, match="needs a polykv Plan"):
        polykv.answer(model, "plan.json", TOK, context=CONTEXT, questions="What?")
    other = polykv.uniform_plan(geometry_of_model(tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)),
                                prefill="snapkv", decode="full", capacity=16)
    with pytest.raises(PlanError) as err:
        polykv.answer(model, other, TOK, context=CONTEXT, questions="What?")
    assert "layer" in str(err.value) and "\n" not in str(err.value)
    assert forwards == []


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, True])
def test_capture_prefill_refuses_a_chunk_size_that_is_not_a_positive_count(model, plan, forwards, chunk_size):
    """0 used to mean 'unchunked' here while prefill refused it: both refuse it now, before the model runs."""
    import torch

    from polykv.runtime.fork import capture_prefill

    with pytest.raises(RuntimeConfigError, match=r"capture_prefill\(chunk_size=...\) must be a positive whole"):
        capture_prefill(model, torch.ones(1, 8, dtype=torch.long), [plan], chunk_size=chunk_size)
    assert forwards == []
