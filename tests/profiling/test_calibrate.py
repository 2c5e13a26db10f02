"""calibrate(): resumable after an interruption, deterministic with a seed, and its profile loads and solves."""

from __future__ import annotations

import os

import numpy as np
import pytest

from polykv.errors import ProfileError
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import candidate_configs, query_stats_path
from polykv.profiling.profile import load_profile
from polykv.adapters.rules.query_stats import QueryStats
from polykv.registry import get_registry
from polykv.solvers import solve


class Interrupted(Exception):
    pass


def _tables(profile):
    return {**{f"metric:{k}": v for k, v in profile.metrics.items()},
            **{f"stat:{k}": s.values for k, s in profile.stats.items()}}


@pytest.fixture(scope="module")
def reference(model, sequences, small_settings):
    """An uninterrupted run with the runtime-measured statistics switched on."""
    settings = small_settings(delta_ppl_sequences=1, validate_configs=5)
    return calibrate(model, sequences(2), settings, heldout=sequences(1, seed=7))


def test_resume_after_interruption_recomputes_only_missing_layers(model, sequences, small_settings, reference,
                                                                  tmp_path):
    settings = small_settings(delta_ppl_sequences=1, validate_configs=5)
    folder = tmp_path / "x.profile.json.partial"
    computed = []

    def stop_after_two(layer):
        computed.append(layer)
        if len(computed) == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        calibrate(model, sequences(2), settings, heldout=sequences(1, seed=7), checkpoint_dir=str(folder),
                  on_layer=stop_after_two)
    assert sorted(os.listdir(folder)) == ["layer-000.npz", "layer-001.npz", "run.json"]
    resumed = []
    result = calibrate(model, sequences(2), settings, heldout=sequences(1, seed=7), checkpoint_dir=str(folder),
                       on_layer=resumed.append)
    assert resumed == [2]
    ours, theirs = _tables(result.profile), _tables(reference.profile)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-9, err_msg=name)


def test_checkpoint_of_another_run_is_refused(model, sequences, small_settings, tmp_path):
    folder = str(tmp_path / "p.partial")
    with pytest.raises(Interrupted):
        calibrate(model, sequences(2), small_settings(), checkpoint_dir=folder,
                  on_layer=lambda layer: (_ for _ in ()).throw(Interrupted()))
    with pytest.raises(ProfileError, match="different calibration run"):
        calibrate(model, sequences(2, seed=1), small_settings(), checkpoint_dir=folder)


def test_same_seed_same_profile_other_seed_other_random_rule(model, sequences, small_settings):
    a = calibrate(model, sequences(2), small_settings(rules=("random", "tova"))).profile
    b = calibrate(model, sequences(2), small_settings(rules=("random", "tova"))).profile
    c = calibrate(model, sequences(2), small_settings(rules=("random", "tova"), seed=1)).profile
    assert a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.table("l2"), b.table("l2"))
    random_cols = [i for i, cfg in enumerate(a.configs) if cfg.rule == "random"]
    tova_cols = [i for i, cfg in enumerate(a.configs) if cfg.rule != "random"]
    assert not np.array_equal(a.table("l2")[:, random_cols], c.table("l2")[:, random_cols])
    np.testing.assert_array_equal(a.table("l2")[:, tova_cols], c.table("l2")[:, tova_cols])


def test_profile_round_trips_and_solves(reference, model, tmp_path):
    path = str(tmp_path / "tiny.profile.json")
    reference.profile.save(path)
    reference.query_stats.save(query_stats_path(path))
    prof = load_profile(path)
    assert prof.fingerprint == reference.profile.fingerprint
    assert set(prof.stats) >= {"cosine", "entropy", "delta_ppl", "kl_sampled", "l2_kl_correlation"}
    assert prof.stats["kl_sampled"].values.shape == (3, 5)
    assert np.all(prof.stats["kl_sampled"].values >= 0)
    from polykv.models.geometry import geometry_of_model

    prof.check_model(geometry_of_model(model))
    QueryStats.load(query_stats_path(path)).check_model(model)
    budget = Budget.parse("4x", 64)
    exact = solve(prof, budget, "exact")
    greedy = solve(prof, budget, "moend-greedy", rule="tova")
    assert exact.provenance.predicted_bytes <= budget.to_bytes(prof.model)
    assert exact.provenance.predicted_loss <= greedy.provenance.predicted_loss + 1e-12
    route = solve(prof, Budget.parse("16tok", 64), "profile-route", allocation="delta-ppl")
    assert route.num_layers == 3


def test_design_space_is_moend_grid_per_rule_with_one_full_column(small_settings):
    settings = small_settings(rules=("tova", "h2o"), keeps=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
    configs = candidate_configs(settings.rules, settings, get_registry())
    assert len(configs) == 9 + 2 * 45
    assert [c.rule for c in configs[:9]] == ["full"] * 9
    assert {(c.k_bits, c.v_bits) for c in configs[:9]} == {(k, v) for k in (16, 8, 4) for v in (16, 8, 4)}
    assert all(c.phase == "prefill" and c.keep < 1 for c in configs[9:])
    with pytest.raises(ProfileError, match="does not run in phase 'decode'"):
        candidate_configs(("snapkv",), small_settings(phase="decode"), get_registry())


def test_sequences_must_outlast_the_prefix(model, sequences, small_settings):
    with pytest.raises(ProfileError, match="longer than the prefix"):
        calibrate(model, sequences(1, length=64), small_settings())
