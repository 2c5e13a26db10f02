"""The runtime on the real default model (SmolLM2-135M-Instruct): full plan = vanilla, and a
compressing plan holds the bytes it predicts."""

from __future__ import annotations

import pathlib

import pytest
import torch

import polykv
from polykv.memory import predict_resident

pytestmark = pytest.mark.model

STEPS = 64
PROMPT = ("The Python standard library contains built-in modules that provide access to system "
          "functionality such as file I/O, as well as modules written in Python that provide standardized "
          "solutions for many problems that occur in everyday programming. Some of these modules are")


def test_full_plan_reproduces_vanilla_greedy_generation(default_model, default_geometry):
    model, tokenizer = default_model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with polykv.apply(model, polykv.full_plan(default_geometry)):
            got = model.generate(ids, **kwargs)
    assert got.sequences.shape[1] == ids.shape[1] + STEPS
    assert torch.equal(got.sequences, ref.sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits))
    assert diff <= 1e-4, f"logits differ by {diff}"


def test_compressed_plan_holds_the_predicted_bytes(default_model, default_geometry):
    model, tokenizer = default_model
    ids = tokenizer(PROMPT * 6, return_tensors="pt").input_ids          # ~270 tokens
    T = ids.shape[1]
    plan = polykv.uniform_plan(default_geometry, prefill="snapkv", decode="tova", capacity_ratio=0.25,
                               k_bits=4, v_bits=8)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids)
        measured = session.resident_bytes()
    rows = predict_resident(plan, default_geometry, T, dtype_bytes=4)
    predicted = sum(r.resident_bytes for r in rows)
    assert measured.total == predicted
    full = default_geometry.full_cache_bytes(T, dtype_bytes=4)
    assert full / measured.total > 4.0                                    # 4x fewer tokens, fewer bits


def test_a_short_prompt_reserves_no_more_than_its_tokens_and_the_decode_slack(default_model, default_geometry):
    """The README tour: a 21-token prompt, 16 new tokens. A layer whose capacity is far above the prompt used to
    reserve capacity + slack rows up front (5.4x vanilla's cache); every shipped plan now holds no more than
    vanilla's rows plus its decode slack's (and the one row the next decode token writes)."""
    model, tokenizer = default_model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :21]
    new = 16
    row_bytes = default_geometry.full_cache_bytes(1, dtype_bytes=4)               # K + V, every layer, one token
    plans = sorted(pathlib.Path(__file__).resolve().parents[2].glob("plans/smollm2-135m-instruct.*.plan.json"))
    assert len(plans) >= 30
    for path in plans:
        plan = polykv.load_plan(str(path))
        with torch.no_grad(), polykv.apply(model, plan) as session:
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            held = session.resident_bytes().total
        vanilla_rows = ids.shape[1] + new - 1                                      # the last token is not cached
        assert held <= row_bytes * (vanilla_rows + plan.trigger.decode_slack + 1), path.name
