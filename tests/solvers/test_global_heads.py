"""``global`` reads a profile's per-KV-head losses (``head_metrics``) to price its members' head shares."""

from __future__ import annotations

import itertools

import attrs
import numpy as np

from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.global_budget import head_priced

T = 2048
BUDGET = Budget.parse("4x", T, basis="resident", cache_dtype="bfloat16")
KEEPS = (0.1, 0.25, 0.5, 0.75)


def _profile(layers: int = 4, heads: int = 2) -> Profile:
    configs = [c for c in moend_configs("kvzip", "prefill", keeps=KEEPS, k_bits=(16,), v_bits=(16,))]
    configs.append(CandidateConfig(rule="full", keep=1.0, k_bits=16, v_bits=16))
    loss = np.array([[(1 - c.keep) * (1 + layer) for c in configs] for layer in range(layers)])
    return Profile.from_table(loss, configs, (layers, heads, 64))


def _brute(profile, heads, table, layer, col):
    keep = profile.configs[col].keep
    options = [(round(c.keep * 1000), i) for i, c in enumerate(profile.configs)]
    best = min(sum(heads[layer, h, i] for h, (_, i) in enumerate(split))
               for split in itertools.product(options, repeat=heads.shape[1])
               if sum(u for u, _ in split) <= round(keep * 1000) * heads.shape[1])
    return table[layer, col] * min(1.0, best / heads[layer, :, col].sum())


def test_a_member_is_priced_at_its_best_head_split():
    base = _profile()
    loss = base.metrics["l2"]
    heads = np.stack([loss * 1.8, loss * 0.2], axis=1)
    profile = attrs.evolve(base, head_metrics={"l2": heads})
    cols = [i for i, c in enumerate(profile.configs) if not c.keeps_everything]
    priced = head_priced(profile, profile.table(), None, cols)
    for layer in range(4):
        for c in cols:
            assert priced[layer, c] == _brute(profile, heads, loss, layer, c)
    assert (priced <= loss).all()
    wide = [c for c in cols if profile.configs[c].keep >= 0.5]  # room to keep head 0 longer, evict head 1 harder
    assert (priced[:, wide] < loss[:, wide]).all()
    even = attrs.evolve(base, head_metrics={"l2": np.stack([loss, loss], axis=1)})
    np.testing.assert_array_equal(head_priced(even, even.table(), None, cols), loss)  # even heads: no gain


def test_global_reads_the_head_table_and_says_so():
    base = _profile()
    loss = base.metrics["l2"]
    with_heads = attrs.evolve(base, head_metrics={"l2": np.stack([loss * 1.8, loss * 0.2], axis=1)})
    plain = solve(base, BUDGET, "global", allocator="kvzip")
    split = solve(with_heads, BUDGET, "global", allocator="kvzip")
    assert split.provenance.predicted_loss < plain.provenance.predicted_loss
    assert "head_metrics.l2" in split.provenance.note and "head" not in plain.provenance.note
    assert split.provenance.predicted_bytes <= BUDGET.to_bytes(base.model)


def test_a_head_table_of_another_metric_is_named_not_used():
    base = _profile()
    loss = base.metrics["l2"]
    two = attrs.evolve(base, metrics={"l2": loss, "kl": loss * 2}, routing_metric="kl",
                       head_metrics={"l2": np.stack([loss * 1.8, loss * 0.2], axis=1)})
    plan = solve(two, BUDGET, "global", allocator="kvzip")
    assert "members priced per layer: head_metrics has no kl table" in plan.provenance.note
    same = solve(attrs.evolve(two, head_metrics=None), BUDGET, "global", allocator="kvzip")
    assert plan.provenance.predicted_loss == same.provenance.predicted_loss
