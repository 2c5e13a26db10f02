"""The end-to-end kl metric: each (layer, config) measured through the runtime from one prefill per sequence.

Checked against a direct runtime measurement (polykv.apply, Session.prefill, the follow-up forward) of the
same one-layer plan, for measured and additively composed columns, a probe rule (kvzip) included; resume
gives the same profile; solvers route on the profile's routing metric; old profiles route on l2.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from polykv.cli import main
from polykv.errors import ProfileError
from polykv.models.geometry import geometry_of_model
from polykv.profiling import endtoend as e2e
from polykv.profiling import validation as val
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import default_rules
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.solvers import solve

KVZIP = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 32}


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def settings(small_settings):
    return small_settings(rules=("h2o", "random", "tova", "kvzip"), keeps=(0.25, 1.0), bits=(16, 4),
                          validate_configs=3, rule_params={"kvzip": KVZIP})


@pytest.fixture(scope="module")
def result(model, sequences, settings):
    return calibrate(model, sequences(2), settings, heldout=sequences(2, seed=7))


def _direct_kl(model, geometry, layer, config, heldout, prefix):
    """KL of the one-layer plan measured directly: a fresh session's prefill, then the follow-up forward."""
    out = 0.0
    for s in heldout:
        ref = val.reference_logprobs(model, s, prefix)
        lp = val.plan_logprobs(model, val.config_plan(geometry, layer, config), s, prefix)
        out += val.kl_divergence(ref[1:], lp[1:]) / len(heldout)   # position 0 is predicted before compression
    return out


def test_measured_kl_equals_a_direct_runtime_measurement(model, sequences, result, prefix):
    prof, geometry = result.profile, geometry_of_model(model)
    measured = e2e.kl_columns(prof.configs, "subset")
    assert {prof.configs[c].rule for c in measured} == {"full", "h2o", "random", "tova", "kvzip"}
    for col in measured:
        config = prof.configs[col]
        for layer in (0, 2):
            direct = _direct_kl(model, geometry, layer, config, sequences(2, seed=7), prefix)
            assert prof.table("kl")[layer, col] == pytest.approx(direct, rel=1e-6, abs=1e-12), (config.label, layer)
    assert (prof.table("kl")[:, measured] > 0).all()


def test_composed_columns_are_eviction_plus_widths(result):
    prof = result.profile
    kl, configs = prof.table("kl"), prof.configs
    label = {c.label: i for i, c in enumerate(configs)}
    for i, c in enumerate(configs):
        if c.keeps_everything or (c.k_bits, c.v_bits) == (16, 16):
            continue
        evict = label[c.label.replace(f"K{c.k_bits}V{c.v_bits}", "K16V16")]
        widths = label[f"full@1/both/K{c.k_bits}V{c.v_bits}"]
        np.testing.assert_allclose(kl[:, i], kl[:, evict] + kl[:, widths], rtol=1e-12)
    assert "composed additively" in prof.provenance.note


def test_all_mode_measures_every_config(model, sequences, small_settings, prefix):
    settings = small_settings(rules=("tova",), keeps=(0.5, 1.0), bits=(16, 4), kl_configs="all")
    prof = calibrate(model, sequences(2), settings, heldout=sequences(1, seed=7)).profile
    geometry = geometry_of_model(model)
    col = next(i for i, c in enumerate(prof.configs) if c.rule == "tova" and (c.k_bits, c.v_bits) == (4, 4))
    direct = _direct_kl(model, geometry, 1, prof.configs[col], sequences(1, seed=7), prefix)
    assert prof.table("kl")[1, col] == pytest.approx(direct, rel=1e-6)
    assert "composed" not in prof.provenance.note


def test_probe_rule_is_calibrated_by_default_and_its_l2_selects_as_the_runtime(model, sequences, result, prefix):
    """kvzip's l2 rows come from the runtime's prefill with its probe: the tokens its l2 keeps are exactly the
    tokens the runtime keeps on that layer."""
    from polykv.profiling.sensitivity import PrefixRun
    from polykv.profiling.capture import capture_sequence, stack_layer
    from polykv.runtime import apply

    assert "kvzip" in default_rules(get_registry())
    prof = result.profile
    cols = [i for i, c in enumerate(prof.configs) if c.rule == "kvzip"]
    assert cols and np.isfinite(prof.table("l2")[:, cols]).all() and (prof.table("l2")[:, cols] > 0).all()
    assert "kvzip" in prof.stat("cosine").columns
    # the selection the l2 path measures is the runtime's
    from polykv.profiling import calibrate as cal
    from polykv.profiling.calibrate_settings import CalibrationSettings
    from polykv.profiling.sensitivity import LayerContext

    seqs, geometry = sequences(2), geometry_of_model(model)
    config = prof.configs[cols[0]]                    # carries kvzip's parameters

    s = CalibrationSettings(rules=("kvzip",), prefix=prefix, rule_params={"kvzip": KVZIP})
    reg = get_registry()
    ctx = LayerContext(registry=reg, quantizer=reg.quantizer("kivi")(), seed=0, rule_params=s.rule_params)
    ctx.prefills = cal._probe_prefills(model, geometry, [1], ["kvzip"], seqs, prefix, s, reg, {})
    cap = stack_layer([capture_sequence(model, x) for x in seqs], 1)
    capacity = 16
    kept = PrefixRun(cap, prefix, "kvzip", config.params, ctx).select(capacity)
    plan = val.one_layer_plan(geometry, 1, rule="kvzip", capacity=capacity, params=config.params)
    with apply(model, plan) as session:
        session.prefill(torch.stack([x[:prefix] for x in seqs]))
        runtime = session.cache.layers[1].positions
    assert torch.equal(kept.positions.sort(-1).values, runtime.sort(-1).values)


def test_resume_after_interruption_gives_the_same_profile(model, sequences, settings, result, tmp_path):
    folder = str(tmp_path / "x.partial")
    with pytest.raises(Interrupted):
        calibrate(model, sequences(2), settings, heldout=sequences(2, seed=7), checkpoint_dir=folder,
                  on_layer=lambda layer: (_ for _ in ()).throw(Interrupted()) if layer == 1 else None)
    assert sorted(os.listdir(folder)) == ["layer-000.npz", "layer-001.npz", "run.json"]
    resumed = []
    again = calibrate(model, sequences(2), settings, heldout=sequences(2, seed=7), checkpoint_dir=folder,
                      on_layer=resumed.append)
    assert resumed == [2]
    assert again.profile.fingerprint == result.profile.fingerprint


def test_solvers_route_on_the_profile_metric_and_metric_picks_another(result, tmp_path):
    prof = result.profile
    assert prof.routing_metric == "kl" and prof.default_metric == "kl"
    budget = Budget.parse("4x", 64)
    by_default = solve(prof, budget, "exact")
    on_kl = solve(prof, budget, "exact", metric="kl")
    on_l2 = solve(prof, budget, "exact", metric="l2")
    assert by_default.layers == on_kl.layers
    assert by_default.provenance.predicted_loss == pytest.approx(on_kl.provenance.predicted_loss)
    assert "routed on metric 'kl' (the profile routing metric)" in by_default.provenance.note
    assert "routed on metric 'l2' (asked for)" in on_l2.provenance.note
    path = str(tmp_path / "p.profile.json")
    prof.save(path)
    loaded = load_profile(path)
    assert loaded.routing_metric == "kl" and loaded.fingerprint == prof.fingerprint
    for metric, want in (("kl", on_kl), ("l2", on_l2)):
        out = str(tmp_path / f"{metric}.plan.json")
        assert main(["solve", path, "--budget", "4x", "--context", "64", "--basis", "nominal", "--metric", metric,
                     "-o", out]) == 0
        plan = json.load(open(out))
        assert f"routed on metric '{metric}'" in plan["provenance"]["note"]
        assert plan["provenance"]["predicted_loss"] == pytest.approx(want.provenance.predicted_loss)


def test_metric_flag_errors(result, tmp_path, capsys):
    path = str(tmp_path / "p.profile.json")
    result.profile.save(path)
    out = str(tmp_path / "x.plan.json")
    assert main(["solve", path, "--budget", "4x", "--context", "64", "--metric", "ppl", "-o", out]) == 2
    assert "has no such metric table" in capsys.readouterr().err
    assert main(["solve", path, "--budget", "4x", "--context", "64", "--metric", "kl", "--param", "metric=l2",
                 "-o", out]) == 2
    assert "disagree" in capsys.readouterr().err


def test_old_profiles_route_on_l2_and_solve_as_before(result, tmp_path):
    """A profile without routing_metric (every profile of before) loads, routes on l2 and fingerprints as it did."""
    from polykv.profiling.profile import loads
    from polykv.profiling.profile_writing import dumps

    text = dumps(result.profile)
    old = json.loads(text)
    del old["routing_metric"]
    prof = loads(json.dumps(old))
    assert prof.routing_metric is None and prof.default_metric == "l2"
    assert '"routing_metric"' not in dumps(prof)
    budget = Budget.parse("4x", 64)
    assert solve(prof, budget, "exact").layers == solve(result.profile, budget, "exact", metric="l2").layers
    assert solve(prof, budget, "exact").provenance.note == solve(result.profile, budget, "exact", metric="l2"
                                                                 ).provenance.note.replace(
        "; routed on metric 'l2' (asked for)", "").replace("routed on metric 'l2' (asked for)", "")
    shipped = load_profile("profiles/smollm2-135m-instruct.profile.json")
    assert shipped.routing_metric is None and shipped.default_metric == "l2"
    with pytest.raises(ProfileError, match="routing_metric"):
        loads(json.dumps({**old, "routing_metric": "ppl"}))
