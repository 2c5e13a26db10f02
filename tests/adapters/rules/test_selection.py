"""Selection helpers: exact top-k at long context, ragged top-k, merges."""

from __future__ import annotations

import torch

from polykv.contract.selection import Merge, Selection, ragged_top_k, top_k_sorted


def test_top_k_keeps_unequal_scores_in_order_at_long_context():
    """At T = 65,536 a 1.05e-6 token must win over a 1.00e-6 token, however far apart they are."""
    T = 65_536
    scores = torch.zeros(1, 1, T)
    scores[..., 10] = 1.00e-6                 # early, slightly lower
    scores[..., T - 10] = 1.05e-6             # late, slightly higher
    assert top_k_sorted(scores, 1).tolist() == [[[T - 10]]]
    assert top_k_sorted(scores.double(), 1).tolist() == [[[T - 10]]]
    # Ties keep the earlier token, deterministically.
    tied = torch.full((1, 1, T), 0.5)
    assert top_k_sorted(tied, 3).tolist() == [[[0, 1, 2]]]


def test_top_k_equals_a_naive_stable_ranking():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (2, 3, 200), generator=g).float()
    got = top_k_sorted(scores, 37)
    for b in range(2):
        for h in range(3):
            row = scores[b, h].tolist()
            ranked = sorted(range(200), key=lambda j: (-row[j], j))[:37]
            assert got[b, h].tolist() == sorted(ranked)


def test_ragged_top_k_is_right_aligned_per_head():
    scores = torch.tensor([[[5., 1., 4., 3., 2.], [1., 2., 3., 4., 5.]]])
    sel = ragged_top_k(scores, torch.tensor([[2, 4]]))
    assert sel.counts.tolist() == [[2, 4]]
    kept = [row[sel.width - int(c):] for row, c in zip(sel.index[0].tolist(), sel.counts[0].tolist())]
    assert kept == [[0, 2], [1, 2, 3, 4]]
    assert sel.kept_mask().tolist() == [[[False, False, True, True], [True, True, True, True]]]


def test_merge_adds_weighted_evicted_tokens_into_targets():
    x = torch.arange(12.).view(1, 1, 6, 2)
    merge = Merge(evicted=torch.tensor([[[1]]]), targets=torch.tensor([[[[2, 3]]]]),
                  weights=torch.tensor([[[[0.5, 0.25]]]]))
    out, touched = merge.apply(x)
    want = x.clone()
    want[0, 0, 2] += 0.5 * x[0, 0, 1]
    want[0, 0, 3] += 0.25 * x[0, 0, 1]
    assert torch.equal(out, want)
    assert touched[0, 0].tolist() == [False, False, True, True, False, False]
    scaled = Merge(evicted=torch.tensor([[[1]]]), targets=torch.tensor([[[[2, 2]]]]),
                   weights=torch.tensor([[[[0.5, 0.0]]]]), target_scale=torch.full((1, 1, 6), 0.5))
    out, _ = scaled.apply(x)
    assert torch.allclose(out[0, 0, 2], 0.5 * x[0, 0, 2] + 0.5 * x[0, 0, 1])
    assert Selection(index=torch.tensor([[[0, 2]]]), merge=merge).head_counts().tolist() == [[2]]
