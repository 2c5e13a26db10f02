"""``refine`` on a model with window-bounded layers (a tiny Gemma 3: sliding, sliding, full; window 8).

The solver sees only the unbounded layer (:mod:`polykv.solvers.windowed`) but measures whole plans: every
candidate runs with the sliding layers at their window, and the KL it records is the whole plan's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polykv.models.geometry import FULL, SLIDING, geometry_of_model
from polykv.profiling.budget import Budget
from polykv.profiling.plan_meter import PlanMeter, heldout_sequences
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn

T, FOLLOW, WINDOW = 64, 16, 8
PARAMS = {"tokens": T, "follow_up": FOLLOW, "sequences": 2, "steps": 3, "tries": 4}
BUDGET = Budget.parse("2x", T, basis="resident")


@pytest.fixture(scope="module")
def gemma3(saved_tiny_model):
    import transformers
    from transformers import AutoTokenizer

    from polykv.testing import random_model

    tokenizer = AutoTokenizer.from_pretrained(saved_tiny_model(32))
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=len(tokenizer), max_position_embeddings=256, sliding_window=WINDOW,
        layer_types=[SLIDING, SLIDING, FULL], pad_token_id=0)
    model = random_model(cfg)
    return model, tokenizer, geometry_of_model(model)


@pytest.fixture(scope="module")
def profile(gemma3):
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 0.75, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    wrong = np.array([c.keep + (c.k_bits + c.v_bits) / 64 for c in configs])  # less loss for less memory
    table = wrong + 0.01 * np.random.default_rng(0).random((3, len(configs)))
    return Profile.from_table(table, configs, gemma3[2])


@pytest.fixture(scope="module")
def refined(gemma3, profile):
    model, tokenizer, _ = gemma3
    return solve(profile, BUDGET, "refine", model=MeasureOn(model=model, tokenizer=tokenizer, name="tiny-gemma3"),
                 **PARAMS)


def test_refine_keeps_the_windows_and_spends_the_budget_on_the_full_layer(refined, profile):
    assert [lp.layer for lp in refined.layers] == [0, 1, 2]
    assert refined.layers[0].keeps_everything and refined.layers[1].keeps_everything
    assert not refined.layers[2].keeps_everything
    m = refined.provenance.measured
    assert m["refine_kl"] <= m["exact_kl"] and m["measured"] >= 2
    assert "window-bounded layers kept at their window" in refined.provenance.note


def test_what_refine_records_is_the_whole_plan_measured_on_the_model(refined, gemma3, profile):
    model, tokenizer, _ = gemma3
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, _ = heldout_sequences(tokenize, PARAMS["sequences"], T + FOLLOW, seed=0, profile=profile)
    meter = PlanMeter(model, seqs, T, storage_dtype=torch.bfloat16, reuse_prefill=False)
    exact = solve(profile, BUDGET, "exact")
    m = refined.provenance.measured
    assert meter.measure(exact) == pytest.approx(m["exact_kl"], rel=1e-5)
    assert meter.measure(refined) == pytest.approx(m["refine_kl"], rel=1e-5)
