"""Hugging Face ``pipeline("text-generation")`` inside ``with polykv.apply(model, plan)``."""

from __future__ import annotations

import pytest
import transformers

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.storage.token_buffer import grown_capacity

PROMPT = "The word to repeat is amber; garden kettle meadow rocket violin walnut zipper harbor. Repeat it:" * 2


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_hf_folder):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_hf_folder)
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_folder).eval(), tok


def test_pipeline_under_the_full_plan_generates_what_transformers_does(model_and_tokenizer):
    model, tok = model_and_tokenizer
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    vanilla = pipe(PROMPT, max_new_tokens=16, do_sample=False)
    with polykv.apply(model, polykv.full_plan(geometry_of_model(model))) as session:
        ours = pipe(PROMPT, max_new_tokens=16, do_sample=False)
        assert session.cache is not None  # the pipeline's generate ran on the plan's cache
        P = len(tok(PROMPT).input_ids)
        T = P + 16 - 1
    assert ours == vanilla and len(ours[0]["generated_text"]) > len(PROMPT)
    geo = geometry_of_model(model)
    rows = grown_capacity(T, P)  # exactly the prompt, then blocks of 16 rows while decoding (polykv.storage.token_buffer)
    assert session.resident_bytes().total == 2 * geo.num_layers * geo.num_kv_heads * geo.head_dim * rows * 4
    assert pipe(PROMPT, max_new_tokens=16, do_sample=False) == vanilla  # the model is plain again after the block


def test_pipeline_under_a_compressing_plan(model_and_tokenizer):
    model, tok = model_and_tokenizer
    plan = polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", decode="h2o", capacity=24, decode_slack=4)
    with polykv.apply(model, plan) as session:
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)  # made inside works too
        out = pipe([PROMPT, PROMPT[:60]], max_new_tokens=12, do_sample=False)       # one prompt at a time
        held = session.resident_bytes().total
        with pytest.raises(RuntimeConfigError, match="padded positions"):
            pipe([PROMPT, PROMPT[:60]], max_new_tokens=12, do_sample=False, batch_size=2)
    assert [len(o[0]["generated_text"]) > 0 for o in out] == [True, True]
    geo = geometry_of_model(model)
    # capacity + slack + one reserved row, not the prompt
    assert held <= 2 * geo.num_layers * geo.num_kv_heads * geo.head_dim * (24 + 4 + 1) * 4
