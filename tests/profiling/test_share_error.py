"""The layer-pair error measure: both layers' follow-up attention error when the pair's prefix is merged."""

from __future__ import annotations

import pytest
import torch

from polykv.profiling.capture import capture_sequence
from polykv.profiling.share_error import pair_error, pair_errors
from polykv.storage.layer_share import merge_pair
from polykv.testing import tiny_model, token_ids


@pytest.fixture(scope="module")
def captures():
    return capture_sequence(tiny_model(layers=3), token_ids(1, 48, seed=2))


def _by_hand(cap, restored_k, restored_v, prefix):
    """Causal attention of the follow-up queries over restored prefix + raw follow-up, G query heads per KV head."""
    k = torch.cat([restored_k, cap.key[:, :, prefix:]], dim=2)
    v = torch.cat([restored_v, cap.value[:, :, prefix:]], dim=2)
    G = cap.query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    ref_k, ref_v = cap.key.repeat_interleave(G, 1), cap.value.repeat_interleave(G, 1)
    q = cap.query[:, :, prefix:]
    T = k.shape[2]
    mask = torch.ones(T - prefix, T, dtype=torch.bool).tril(prefix)
    out = torch.softmax((q @ k.transpose(-1, -2) * cap.scaling).masked_fill(~mask, float("-inf")), -1) @ v
    ref = torch.softmax((q @ ref_k.transpose(-1, -2) * cap.scaling).masked_fill(~mask, float("-inf")), -1) @ ref_v
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("t,ratio", [(0.6, 0.05), (0.5, 0.25)])
def test_pair_error_equals_attention_by_hand_on_the_restored_prefix(captures, t, ratio):
    P = 32
    lo, hi = captures[1], captures[2]
    got = pair_error(lo, hi, P, interpolation=t, retention_ratio=ratio)
    pk = merge_pair(lo.key[:, :, :P], hi.key[:, :, :P], interpolation=t, retention_ratio=ratio)
    pv = merge_pair(lo.value[:, :, :P], hi.value[:, :, :P], interpolation=t, retention_ratio=ratio)
    assert got.lower_error == pytest.approx(_by_hand(lo, pk.restore(0), pv.restore(0), P), rel=1e-4)
    assert got.upper_error == pytest.approx(_by_hand(hi, pk.restore(1), pv.restore(1), P), rel=1e-4)
    assert got.lower_error > 0 and got.upper_error > 0 and got.total == got.lower_error + got.upper_error


def test_keeping_every_token_unmerged_has_no_error_and_more_retention_helps(captures):
    exact = pair_error(captures[0], captures[1], 32, retention_ratio=1.0)
    assert exact.lower_error < 1e-6 and exact.upper_error < 1e-6
    some = pair_error(captures[0], captures[1], 32, retention_ratio=0.5)
    none = pair_error(captures[0], captures[1], 32, retention_ratio=0.0)
    assert some.total < none.total


def test_every_adjacent_pair_by_default_and_bad_pairs_refused(captures):
    assert [(e.lower, e.upper) for e in pair_errors(captures, 32)] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="two adjacent layers, got layers 0 and 2"):
        pair_error(captures[0], captures[2], 32)
    with pytest.raises(ValueError, match="prefix 48 must lie strictly inside"):
        pair_error(captures[0], captures[1], 48)
