"""Budgets: the three units, the nominal bytes formula, and bad input."""

from __future__ import annotations

import pytest

from polykv.errors import SolverError
from polykv.profiling.budget import Budget, full_cache_bytes, layer_bits, tokens_for_keep
from polykv.profiling.profile import ProfileModel
from polykv.plan import OpSpec

MODEL = ProfileModel(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's shape


def test_nominal_formula():
    # m_l = keep * T * Hkv * d * (k_bits + v_bits) / 8 with keep * T rounded up to whole tokens
    assert layer_bits(MODEL, 0.25, 8, 4, 4096) // 8 == 1024 * 3 * 64 * 12 // 8
    assert layer_bits(MODEL, 0.1, 4, 4, 4096) == 410 * 3 * 64 * 8
    assert full_cache_bytes(MODEL, 4096) == 30 * 4096 * 3 * 64 * 4 == 94371840
    for keep in (0.1, 0.25, 1 / 3, 0.9, 1.0):
        for T in (1, 7, 100, 4097):
            assert tokens_for_keep(keep, T) == OpSpec(rule="x", capacity_ratio=keep).resolve_capacity(T)


@pytest.mark.parametrize("text,kind,value,nbytes", [
    ("94371840", "bytes", 94371840, 94371840),
    ("3MiB", "bytes", 3 * 2**20, 3 * 2**20),
    ("1.5kb", "bytes", 1500, 1500),
    ("8x", "ratio", 8.0, 94371840 // 8),
    ("2.5x", "ratio", 2.5, int(94371840 // 2.5)),
    ("256tok", "tokens_per_layer", 256, 30 * 256 * 3 * 64 * 4),
])
def test_parse_and_convert(text, kind, value, nbytes):
    b = Budget.parse(text, 4096)
    assert (b.kind, b.value, b.context_tokens) == (kind, value, 4096)
    assert b.to_bytes(MODEL) == nbytes and b.to_bits(MODEL) == 8 * nbytes
    assert list(b.as_dict()) == [kind]


def test_uniform_tokens():
    assert Budget.parse("256tok", 4096).uniform_tokens(MODEL) == 256
    assert Budget.parse("256tok", 4096).uniform_tokens(MODEL, 8, 4) == 256 * 32 // 12
    assert Budget.parse("1x", 4096).uniform_tokens(MODEL) == 4096


@pytest.mark.parametrize("text,context,pattern", [
    ("lots", 100, "cannot read budget 'lots'"),
    ("0.5x", 100, "ratio below 1"),
    ("0", 100, "must be a positive finite number"),
    ("2.5tok", 100, "whole number"),
    ("1.5", 100, "whole number of bytes"),
    ("8x", 0, "context length must be a positive integer"),
])
def test_bad_budgets(text, context, pattern):
    with pytest.raises(SolverError, match=pattern):
        Budget.parse(text, context)


def test_resident_budget_counts_real_bytes():
    b = Budget.parse("8x", 4096, basis="resident")
    assert b.to_bytes(MODEL) == 94371840 // 8  # the same 16-bit full cache as the ratio basis
    # one 16-bit token in one layer: K and V (3 heads x 64 x 2 bytes each) plus its int64 position per KV head
    assert b.token_bits(MODEL) == 8 * (3 * 64 * 2 * 2 + 3 * 8)
    assert b.uniform_tokens(MODEL) == (94371840 // 8) // 30 // (3 * 64 * 4 + 24) < 512
    assert Budget.parse("8x", 4096).uniform_tokens(MODEL) == 512  # nominal: positions not counted
    assert "resident at T=4096, batch 1, bfloat16" in b.describe()
    two = Budget.parse("8x", 4096, basis="resident", batch=2)
    assert two.to_bytes(MODEL) == 2 * b.to_bytes(MODEL) and two.uniform_tokens(MODEL) == b.uniform_tokens(MODEL)
    with pytest.raises(SolverError, match="batch must be a positive integer"):
        Budget.parse("8x", 4096, basis="resident", batch=0)


def test_tokens_that_fit_never_lands_after_a_dip():
    from polykv.profiling.budget import tokens_that_fit

    # a cost that drops at every 32nd token (a residual block filling): 66 tokens cost 118 <= 120, but 54..63
    # cost more than 120, so a context a little shorter than T would hold more than the budget: stop at 53
    cost = lambda t: 3 * t - 40 * (t // 32)  # noqa: E731
    assert cost(66) <= 120 < cost(54)
    assert tokens_that_fit(cost, 120, 1000) == 53
    assert tokens_that_fit(cost, 10**6, 1000) == 1000
