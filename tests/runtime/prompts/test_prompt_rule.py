"""The prompt rule: a context starts as the model's tokenizer starts a text, the question continues it."""

from __future__ import annotations

import pytest

from polykv.errors import StudyError
from polykv.studies.prompt import PromptEncoder, as_encoder
from polykv.studies.tasks import CharTokenizer, WhitespaceTokenizer
from polykv.studies.tasks.base import prompt_length
from polykv.studies.tasks.continuation import ContinuationTask
from polykv.studies.tasks.passkey import PasskeyTask

BOS = 1
CONTEXT, QUESTION = "The pass key is 12345. Remember it.", "\n\nWhat is the pass key? The pass key is"


def test_auto_follows_a_tokenizer_that_adds_bos_exactly(make_tokenizer):
    tok = make_tokenizer(adds_bos=True)
    ctx, q = PromptEncoder(tok).prompt_ids(CONTEXT, QUESTION)
    assert ctx[0] == BOS and ctx[1:] == tok.encode(CONTEXT, add_special_tokens=False)
    assert BOS not in q and q == tok.encode(QUESTION, add_special_tokens=False)      # no second BOS
    assert ctx + q == tok.encode(CONTEXT + QUESTION)                                 # what the tokenizer makes
    assert (ctx + q).count(BOS) == 1
    enc = PromptEncoder(tok)                                                         # still the tokenizer
    assert enc.eos_token_id == 2 and enc.encode("ab") == tok.encode("ab") and enc.decode([45]) == tok.decode([45])


def test_auto_adds_nothing_where_the_tokenizer_adds_nothing(make_tokenizer):
    tok = make_tokenizer(adds_bos=False)
    ctx, q = PromptEncoder(tok).prompt_ids(CONTEXT, QUESTION)
    assert ctx + q == tok.encode(CONTEXT + QUESTION) and BOS not in ctx + q


@pytest.mark.parametrize("adds_bos", [True, False])
def test_true_and_false_override_the_tokenizer(make_tokenizer, adds_bos):
    tok = make_tokenizer(adds_bos=adds_bos)
    text = tok.encode(CONTEXT, add_special_tokens=False)
    on_ctx, on_q = PromptEncoder(tok, bos=True).prompt_ids(CONTEXT, QUESTION)
    off_ctx, off_q = PromptEncoder(tok, bos=False).prompt_ids(CONTEXT, QUESTION)
    assert on_ctx == [BOS] + text and off_ctx == text
    assert on_q == off_q and BOS not in on_q


def test_a_text_that_starts_with_the_bos_never_gets_a_second(make_tokenizer):
    tok = make_tokenizer(adds_bos=True)
    for bos in ("auto", True):
        ctx, _ = PromptEncoder(tok, bos=bos).prompt_ids("<s>" + CONTEXT, QUESTION)
        assert ctx[0] == BOS and ctx.count(BOS) == 1
    with pytest.raises(StudyError, match="field 'bos' is false but the context itself starts with the BOS"):
        PromptEncoder(tok, bos=False).prompt_ids("<s>" + CONTEXT, QUESTION)


def test_bad_settings_name_the_field(make_tokenizer):
    with pytest.raises(StudyError, match="field 'bos': true asks for a BOS token but the tokenizer"):
        PromptEncoder(CharTokenizer(), bos=True)
    with pytest.raises(StudyError, match="field 'bos'"):
        PromptEncoder(CharTokenizer(), bos="yes")
    with pytest.raises(StudyError, match="field 'prompt_format'"):
        PromptEncoder(CharTokenizer(), prompt_format="instruct")
    with pytest.raises(StudyError, match="needs a tokenizer with a chat template"):
        PromptEncoder(make_tokenizer(adds_bos=True), prompt_format="chat")


def test_offline_tokenizers_add_nothing():
    for tok in (WhitespaceTokenizer(), CharTokenizer()):
        ctx, q = as_encoder(tok).prompt_ids(CONTEXT, QUESTION)
        assert len(ctx) == len(tok.encode(CONTEXT)) and len(q) == len(tok.encode(QUESTION))


@pytest.mark.parametrize("bos", ["auto", True, False])
def test_passkey_length_counts_the_bos(make_tokenizer, bos):
    enc = PromptEncoder(make_tokenizer(adds_bos=True), bos=bos)
    for item in PasskeyTask().make_items(enc, 3, seed=0, length=400):
        ctx, q = enc.prompt_ids(item.context, item.question)
        assert item.meta["tokens"] == len(ctx) + len(q) == prompt_length(enc, item.context, item.question)
        assert abs(item.meta["tokens"] - 400) <= 20
        assert (ctx[0] == BOS) == (bos is not False)


def test_length_fitting_makes_room_for_the_bos(make_tokenizer):
    """The byte tokenizer makes one token per character: with a BOS the haystack is one token shorter
    or less, never the same text plus one token over the requested length."""
    with_bos = PasskeyTask().make_items(PromptEncoder(make_tokenizer(adds_bos=True)), 4, seed=1, length=500)
    without = PasskeyTask().make_items(PromptEncoder(make_tokenizer(adds_bos=False)), 4, seed=1, length=500)
    for a, b in zip(with_bos, without):
        assert a.meta["tokens"] <= 500 and b.meta["tokens"] <= 500
        assert len(a.context) <= len(b.context)


def test_a_continuation_context_counts_its_bos_and_the_continuation_has_none(make_tokenizer):
    enc = PromptEncoder(make_tokenizer(adds_bos=True))
    item = ContinuationTask().make_items(enc, 1, seed=0, context_tokens=300, continuation_tokens=60)[0]
    assert item.meta["context_tokens"] == len(enc.prompt_ids(item.context, "")[0]) == len(item.context) + 1
    assert item.meta["continuation_tokens"] == len(enc.text_ids(item.answers[0])) == len(item.answers[0])


def test_smollm2_with_bos_forced(smollm2_tokenizer):
    """SmolLM2's tokenizer adds no BOS by itself; with ``add_bos_token`` forced, auto follows it."""
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    plain_ctx, plain_q = PromptEncoder(tok).prompt_ids(CONTEXT, QUESTION)
    assert plain_ctx[0] != tok.bos_token_id and plain_ctx + plain_q == tok.encode(CONTEXT + QUESTION)
    tok.add_bos_token = True
    ctx, q = PromptEncoder(tok).prompt_ids(CONTEXT, QUESTION)
    assert ctx[0] == tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert ctx == [1] + plain_ctx and q == plain_q and tok.bos_token_id not in q
    assert ctx + q == tok.encode(CONTEXT + QUESTION)
    forced_ctx, _ = PromptEncoder(smollm2_tokenizer, bos=True).prompt_ids(CONTEXT, QUESTION)
    assert forced_ctx == ctx


def test_smollm2_passkey_items_tokenize_as_one_prompt(smollm2_tokenizer):
    """Encoding the context and the question apart gives the tokens of the whole prompt encoded at once."""
    enc = PromptEncoder(smollm2_tokenizer)
    for item in PasskeyTask().make_items(enc, 2, seed=0, length=512):
        ctx, q = enc.prompt_ids(item.context, item.question)
        assert ctx + q == smollm2_tokenizer.encode(item.context + item.question)
