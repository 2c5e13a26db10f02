"""The runtime on the real default model (SmolLM2-135M-Instruct): full plan = vanilla, and a
compressing plan holds the bytes it predicts."""

from __future__ import annotations

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
