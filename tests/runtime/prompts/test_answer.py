"""``polykv.answer``: the context is compressed once, each question is fed through the compressed cache after it,
and a study item's answer is exactly the API's."""

from __future__ import annotations

import json

import pytest
import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec, uniform_plan
from polykv.runtime.answer import stop_ids
from polykv.runtime.cache import cache_keyword
from polykv.runtime.prompt import PromptEncoder
from polykv.studies.runner import LoadedStudy, prepare, run_study
from polykv.studies.spec import load_spec
from polykv.testing import tiny_model

TINY = {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 262}
CONTEXT = ("The archive keeps its records in order. " * 4 + "The vault code is 417. "
           + "Clerks file the letters by date and by sender. " * 4)
QUESTIONS = [" What is the vault code?", " Who files the letters?"]


@pytest.fixture(scope="module")
def model():
    return tiny_model(**TINY)


def _plan(model):
    return uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=24, decode_slack=4)


@pytest.mark.parametrize("prompt_format", ["plain", "chat"])
def test_each_question_starts_from_the_compressed_context(model, make_tokenizer, prompt_format):
    """Question B answered after question A gets the same tokens and bytes as B asked alone: every question
    starts from the compressed context, never from an earlier question's answer."""
    tok = make_tokenizer(adds_bos=True, chat=True)
    plan = _plan(model)
    both = polykv.answer(model, plan, tok, context=CONTEXT, questions=QUESTIONS, max_new_tokens=8,
                         prompt_format=prompt_format)
    alone = [polykv.answer(model, plan, tok, context=CONTEXT, questions=q, max_new_tokens=8,
                           prompt_format=prompt_format) for q in QUESTIONS]
    assert both.tokens == [a.tokens[0] for a in alone] and both.texts == [a.texts[0] for a in alone]
    assert [len(t) for t in both.tokens] != [0, 0]
    assert both.end_bytes == [a.end_bytes[0] for a in alone]
    assert both.context_bytes == alone[0].context_bytes == alone[1].context_bytes
    ctx, q = PromptEncoder(tok, prompt_format=prompt_format).prompt_ids(CONTEXT, QUESTIONS[1])
    assert both.context_tokens == len(ctx) and both.question_tokens[1] == len(q)
    geo = geometry_of_model(model)
    full_ctx = geo.full_cache_bytes(len(ctx), dtype_bytes=4)
    assert both.context_bytes.total < full_ctx / 2                  # the context was compressed (24 of ~300 tokens)


def test_under_the_full_plan_the_answer_is_vanilla_greedy_on_context_then_question(model, make_tokenizer):
    tok = make_tokenizer(adds_bos=True)
    got = polykv.answer(model, polykv.full_plan(geometry_of_model(model)), tok, context=CONTEXT,
                        questions=QUESTIONS[0], max_new_tokens=10)
    ctx, q = PromptEncoder(tok).prompt_ids(CONTEXT, QUESTIONS[0])
    stop = stop_ids(model, tok)
    ids, out = torch.tensor([ctx + q]), []
    with torch.no_grad():
        for _ in range(10):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in stop:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert got.tokens == [out]


def test_a_study_items_answer_is_the_apis(tmp_path, model, make_tokenizer):
    """The runner answers each item through the same code path: the generated text of every (policy, item)
    record equals ``polykv.answer`` on the item's context and question under that policy's plan."""
    tok = make_tokenizer(adds_bos=True)
    plan_path = tmp_path / "snap.json"
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=24), decode="full")
    plan.save(str(plan_path))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({
        "name": "same", "model": {"tiny": TINY}, "context_tokens": 320, "plans": {"snap": "snap.json"},
        "tasks": [{"task": "passkey", "params": {"length": 320, "digits": 3, "max_new_tokens": 4}, "samples": 2}]}))
    results = str(tmp_path / "results.jsonl")
    prepared = prepare(load_spec(str(spec_path)), results)
    run_study(prepared, model=model, tokenizer=tok, progress=False)
    records = [json.loads(line) for line in open(results) if '"kind": "result"' in line]
    (task, items), = LoadedStudy.load(prepared, model=model, tokenizer=tok).items()
    plans = {"snap": plan, "full": polykv.full_plan(geometry_of_model(model))}
    assert {r["policy"] for r in records} == set(plans) and len(records) == 2 * len(items)
    for record in records:
        item = next(i for i in items if i.id == record["item"])
        got = polykv.answer(model, plans[record["policy"]], tok, context=item.context, questions=item.question,
                            max_new_tokens=item.max_new_tokens)
        assert got.texts == [record["generated"]]
        assert got.context_bytes.total == record["kv_bytes"] and got.end_bytes[0].total == record["kv_bytes_end"]


@pytest.mark.model
def test_a_needle_under_the_full_plan_is_vanilla_with_the_question_fed_after_the_context(default_model):
    """On SmolLM2 (chat template): the answer through the API under the full plan is plain transformers' greedy
    answer when the context is prefilled into a DynamicCache and the question fed after it, and finds the needle."""
    from transformers import DynamicCache

    model, tok = default_model
    context = ("The garden path winds past the old well and the apple trees. " * 10 + "The vault code is 4172. "
               + "Bees hum over the lavender while the gardener rests in the shade. " * 10)
    question = " What is the vault code?"
    got = polykv.answer(model, polykv.full_plan(geometry_of_model(model)), tok, context=context, questions=question,
                        max_new_tokens=12, prompt_format="chat")
    ctx, q = PromptEncoder(tok, prompt_format="chat").prompt_ids(context, question)
    stop, cache, out = stop_ids(model, tok), DynamicCache(config=model.config), []
    kw = cache_keyword(model)
    with torch.no_grad():
        model(torch.tensor([ctx]), use_cache=True, **{kw: cache})
        logits = model(torch.tensor([q]), use_cache=True, **{kw: cache}).logits
        for _ in range(12):
            out.append(int(logits[0, -1].argmax()))
            if out[-1] in stop:
                break
            logits = model(torch.tensor([[out[-1]]]), use_cache=True, **{kw: cache}).logits
    assert got.tokens == [out] and "4172" in got.texts[0]
