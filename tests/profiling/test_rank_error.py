"""The layer-local error of the rank axis, through the runtime's projected path, against independent references."""

from __future__ import annotations

import pytest
import torch

from polykv.attention.low_rank import LowRank
from polykv.models.kv_bases import compute_kv_bases
from polykv.profiling.capture import capture_sequence
from polykv.profiling.rank_error import layer_rank_errors, rank_candidates
from polykv.profiling.sensitivity import full_reference, relative_error
from polykv.attention.kernels import sdpa
from polykv.testing import tiny_model, token_ids

PREFIX = 40


@pytest.fixture(scope="module")
def setup():
    m = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    bases = compute_kv_bases(m, [token_ids(1, 64, seed=1)])
    caps = capture_sequence(m, token_ids(1, 56, seed=7))
    return m, bases, caps


def _reconstructed_error(cap, bases, k_rank, v_rank):
    """Independent: reconstruct K/V on the bases, attend in full width, compare with full attention."""
    lr = LowRank(None if k_rank is None else bases.basis("key", cap.layer_idx, k_rank).to(cap.key.dtype),
                 None if v_rank is None else bases.basis("value", cap.layer_idx, v_rank).to(cap.key.dtype))
    k, v = lr.reconstruct(cap.key, cap.value)
    q = cap.query[:, :, PREFIX:]
    return relative_error(sdpa(q, k, v, cap.scaling), full_reference(cap, PREFIX))


@pytest.mark.parametrize("layer", [0, 1])
def test_the_error_is_the_reconstruct_then_attend_error(setup, layer):
    _, bases, caps = setup
    cands = [(16, 16), (8, 8), (4, None), (None, 12), (12, 4)]
    got = layer_rank_errors(caps[layer], PREFIX, cands, bases)
    want = [_reconstructed_error(caps[layer], bases, *c) for c in cands]
    assert got[0] < 1e-5
    assert all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
    assert got[1] > 1e-3


def test_fewer_channels_lose_more(setup):
    _, bases, caps = setup
    got = layer_rank_errors(caps[1], PREFIX, [(r, r) for r in (16, 12, 8, 4, 2)], bases)
    assert got == sorted(got)


def test_quantized_codes_add_their_own_error(setup):
    _, bases, caps = setup
    qp = {"group_size": 4, "residual": 4}
    plain = layer_rank_errors(caps[0], PREFIX, [(8, 8)], bases)[0]
    coded = layer_rank_errors(caps[0], PREFIX, [(8, 8)], bases, k_bits=2, v_bits=2, quantizer_params=qp)[0]
    assert coded > plain


def test_a_candidate_outside_the_head_dim_is_refused(setup):
    _, bases, caps = setup
    with pytest.raises(ValueError, match=r"layer 0: candidate v_rank 17 must lie in 1\.\.16"):
        layer_rank_errors(caps[0], PREFIX, [(8, 17)], bases)


def test_rank_candidates_round_to_multiples_of_16():
    assert rank_candidates(64) == [64, 48, 32, 16]
    assert rank_candidates(128) == [128, 96, 64, 32]
    assert rank_candidates(16) == [16]
