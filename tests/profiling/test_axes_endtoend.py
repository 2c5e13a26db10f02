"""The rank and layer-sharing axes priced end to end on the objectives, on the scale of the eviction configs."""

from __future__ import annotations

import numpy as np
import pytest

from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.profiling import axes_endtoend as axes
from polykv.profiling import objectives as ob
from polykv.profiling import validation as val
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_axes import pair_losses, rank_label, rank_pairs
from polykv.profiling.profile import loads
from polykv.solvers import solve

from tests.profiling.test_objectives import PREFIX, Words, _held

OBJECTIVES = ("continuation", "reconstruction", "retrieval")


@pytest.fixture(scope="module")
def priced(model, small_settings):
    settings = small_settings(rules=("tova",), keeps=(0.5, 1.0), bits=(16, 4), ranks=(None, 16), pairs=True,
                              prefix=PREFIX, objectives=OBJECTIVES, reconstruction_chunk=32,
                              objective_weights={"retrieval": 2.0})
    result = calibrate(model, _held(2, seed=1), settings, heldout=_held(), tokenizer=Words())
    return settings, result


def _direct(model, plan, items, model_data) -> float:
    """Mean KL at the scored rows of a fresh session that prefills the prefix and runs the follow-up."""
    return float(np.mean([val.kl_divergence(val.reference_logprobs(model, it.ids, PREFIX)[1:][list(it.rows)],
                                            val.plan_logprobs(model, plan, it.ids, PREFIX, model_data=model_data)[1:][
                                                list(it.rows)]) for it in items]))


def test_rank_and_pair_losses_equal_a_fresh_session_on_every_objective(model, priced):
    settings, result = priced
    prof, geometry = result.profile, geometry_of_model(model)
    data = {KV_BASES_KEY: result.model_data[KV_BASES_KEY]}
    built = ob.build(OBJECTIVES, _held(), PREFIX, tokenizer=Words(), seed=settings.seed, chunk_tokens=32)
    pairs = rank_pairs(settings.ranks)
    for name, items in built.items():
        metric = ob.METRIC_OF[name]
        rank = prof.stats[f"rank_{metric}"]
        assert rank.columns == tuple(rank_label(*p) for p in pairs)
        for layer in range(geometry.num_layers):
            for j, (k, v) in enumerate(pairs):
                want = _direct(model, axes.rank_plan(geometry, layer, k, v), items, data)
                assert rank.values[layer, j] == pytest.approx(want, rel=1e-4, abs=1e-7), (name, layer, k, v)
        for upper in prof.pairs.uppers:
            want = _direct(model, axes.pair_plan(geometry, upper), items, data)
            assert prof.stats[f"pair_{metric}"].values[upper, 0] == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert rank.values.max() > 0 and prof.stats[f"pair_{metric}"].values.max() > 0


def test_every_metric_composes_ranks_additively_and_the_mix_is_mixed_again(priced):
    settings, result = priced
    prof = result.profile
    labels = {c.label: i for i, c in enumerate(prof.configs)}
    low = [c for c in prof.configs if c.low_rank]
    assert low and prof.axes == ("tokens", "bits", "rank", "layers")
    for metric in ("l2", "kl", "kl_reconstruction", "kl_retrieval"):
        stat, table = prof.stats[f"rank_{metric}"], prof.table(metric)
        for c in low:
            j = stat.columns.index(rank_label(c.k_rank, c.v_rank))
            np.testing.assert_allclose(table[:, labels[c.label]], table[:, labels[c.base.label]] + stat.values[:, j])
    mix = prof.objective_weights
    np.testing.assert_allclose(prof.table("kl_mix"), sum(w * prof.table(m) for m, w in mix.items()))
    np.testing.assert_allclose(pair_losses(prof, "kl_mix"), sum(w * pair_losses(prof, m) for m, w in mix.items()))
    assert pair_losses(prof, "l2").tolist() == prof.pairs.loss.tolist()
    again = loads(prof.to_json())
    assert again.fingerprint == prof.fingerprint and np.array_equal(pair_losses(again, "kl_mix"),
                                                                    pair_losses(prof, "kl_mix"))


def test_exact_weighs_every_axis_on_the_objective_mix(priced):
    _, result = priced
    prof = result.profile
    budget = Budget.parse("3x", 256, basis="resident")
    plan = solve(prof, budget, "exact")
    assert "routed axes: tokens, bits, rank, layers" in plan.provenance.note
    assert "routed on metric 'kl_mix'" in plan.provenance.note
    on_l2 = solve(prof, budget, "exact", metric="l2")
    assert plan.provenance.predicted_loss is not None and on_l2.provenance.predicted_loss is not None
