"""Chat prompts: the rendered template is cut right after the context; the question part carries the rest."""

from __future__ import annotations

import pytest

from polykv.errors import StudyError
from polykv.studies.prompt import PromptEncoder
from polykv.studies.tasks.passkey import PasskeyTask

CONTEXT, QUESTION = "The pass key is 12345. Remember it.", "\n\nWhat is the pass key? The pass key is"


def test_the_split_reassembles_the_rendered_template(make_tokenizer):
    tok = make_tokenizer(adds_bos=True, chat=True)
    enc = PromptEncoder(tok, prompt_format="chat")
    head, tail = enc.chat_split(CONTEXT, QUESTION)
    assert head == "<s><|user|>\n" + CONTEXT
    assert tail == QUESTION + "<|end|>\n<|assistant|>\n"
    ctx, q = enc.prompt_ids(CONTEXT, QUESTION)
    assert ctx + q == tok.apply_chat_template([{"role": "user", "content": CONTEXT + QUESTION}],
                                              tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ctx[0] == 1 and ctx.count(1) == 1 and 1 not in q          # the template's BOS, no second


def test_bos_settings_act_on_the_template_start(make_tokenizer):
    tok = make_tokenizer(adds_bos=False, chat=True)
    tok.chat_template = tok.chat_template.replace("{{ bos_token }}", "")  # a template that writes no BOS
    auto, _ = PromptEncoder(tok, prompt_format="chat").prompt_ids(CONTEXT, QUESTION)
    forced, _ = PromptEncoder(tok, prompt_format="chat", bos=True).prompt_ids(CONTEXT, QUESTION)
    assert auto[0] != 1 and forced == [1] + auto
    with_bos = make_tokenizer(adds_bos=True, chat=True)
    with pytest.raises(StudyError, match="the rendered chat template"):
        PromptEncoder(with_bos, prompt_format="chat", bos=False).prompt_ids(CONTEXT, QUESTION)


def test_a_template_that_edits_the_context_is_refused(make_tokenizer):
    tok = make_tokenizer(adds_bos=True, chat=True)
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | upper")
    with pytest.raises(StudyError, match="does not reproduce the item's context verbatim"):
        PromptEncoder(tok, prompt_format="chat").prompt_ids(CONTEXT, QUESTION)


def test_smollm2_chat_split(smollm2_tokenizer):
    enc = PromptEncoder(smollm2_tokenizer, prompt_format="chat")
    head, tail = enc.chat_split(CONTEXT, QUESTION)
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_start|>user\n" + CONTEXT)
    assert tail == QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
    ctx, q = enc.prompt_ids(CONTEXT, QUESTION)
    assert ctx[0] == smollm2_tokenizer.bos_token_id   # SmolLM2's BOS is <|im_start|>, the template's first token
    whole = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": CONTEXT + QUESTION}],
                                                  tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ctx + q == whole


def test_chat_passkey_length_counts_the_template(smollm2_tokenizer):
    enc = PromptEncoder(smollm2_tokenizer, prompt_format="chat")
    item = PasskeyTask().make_items(enc, 1, seed=0, length=600)[0]
    ctx, q = enc.prompt_ids(item.context, item.question)
    assert item.meta["tokens"] == len(ctx) + len(q) and abs(len(ctx) + len(q) - 600) <= 30
    plain = PromptEncoder(smollm2_tokenizer)
    assert plain.prompt_length(item.context, item.question) < len(ctx) + len(q) - 20   # system turn and headers
