"""Pricing a config off the profile's grid: one function, the one the study report's predicted losses use."""

from __future__ import annotations

import json

import pytest

from polykv.errors import SolverError
from polykv.profiling.budget import Budget, bits_to_bytes, layer_bits
from polykv.profiling.profile import CandidateConfig
from polykv.solvers import solve
from polykv.solvers.pricing import layer_config, price_config
from polykv.studies import predicted
from polykv.studies.results import FORMAT, Results
from polykv.plan.writing import plan_dict
from tests.studies.runner.conftest import tiny_profile


@pytest.fixture(scope="module")
def profile():
    return tiny_profile()


def _col(profile, keep, kb, vb):
    return next(j for j, c in enumerate(profile.configs) if (c.keep, c.k_bits, c.v_bits) == (keep, kb, vb))


def test_a_grid_point_reads_the_table_and_counts_its_bytes(profile):
    cfg = CandidateConfig(rule="snapkv", keep=0.25, phase="prefill", k_bits=8, v_bits=4)
    price = price_config(profile, 1, cfg, budget=400)
    assert price.how == "measured" and price.loss == profile.table()[1, _col(profile, 0.25, 8, 4)]
    assert price.bytes == bits_to_bytes(layer_bits(profile.model, 0.25, 8, 4, 400))
    resident = price_config(profile, 1, cfg, budget=Budget.parse("4x", 400, basis="resident"))
    assert resident.loss == price.loss and resident.bytes > price.bytes  # scales and metadata counted


def test_a_keep_between_profiled_keeps_is_interpolated_linearly(profile):
    t = profile.table()
    price = price_config(profile, 2, CandidateConfig(rule="snapkv", keep=0.375, phase="prefill", k_bits=8, v_bits=4),
                         budget=400)
    assert price.how == "interpolated"
    assert price.loss == pytest.approx((t[2, _col(profile, 0.25, 8, 4)] + t[2, _col(profile, 0.5, 8, 4)]) / 2)


def test_a_width_between_profiled_widths_is_interpolated_in_bits(profile):
    t = profile.table()
    price = price_config(profile, 0, CandidateConfig(rule="snapkv", keep=0.5, phase="prefill", k_bits=6, v_bits=4),
                         budget=400)
    want = (t[0, _col(profile, 0.5, 4, 4)] + t[0, _col(profile, 0.5, 8, 4)]) / 2
    assert price.loss == pytest.approx(want) and price.how == "interpolated"
    both = price_config(profile, 0, CandidateConfig(rule="snapkv", keep=0.5, phase="prefill", k_bits=6, v_bits=6),
                        budget=400)
    corners = [t[0, _col(profile, 0.5, k, v)] for k in (4, 8) for v in (4, 8)]
    assert both.loss == pytest.approx(sum(corners) / 4)


@pytest.mark.parametrize("cfg, why", [
    (CandidateConfig(rule="snapkv", keep=0.1, phase="prefill", k_bits=8, v_bits=4), "below the lowest profiled keep"),
    (CandidateConfig(rule="snapkv", keep=0.5, phase="prefill", k_bits=2, v_bits=4), "outside the profiled widths"),
    (CandidateConfig(rule="tova", keep=0.5, phase="prefill", k_bits=8, v_bits=4), "is not in the profile"),
])
def test_what_the_profile_cannot_price_has_no_loss_and_says_why(profile, cfg, why):
    price = price_config(profile, 0, cfg, budget=400)
    assert price.loss is None and why in price.how and price.bytes > 0


def test_a_layer_outside_the_profile_or_a_phase_the_rule_cannot_run_is_refused(profile):
    with pytest.raises(SolverError, match="layer 4 is out of range; the profile has layers 0 to 3"):
        price_config(profile, 4, profile.configs[0], budget=400)
    with pytest.raises(SolverError, match="rule 'snapkv' is configured for phase 'both' but does not run in"):
        price_config(profile, 0, CandidateConfig(rule="snapkv", keep=0.5, phase="both", k_bits=8, v_bits=4),
                     budget=400)


def test_the_reports_profile_loss_is_the_sum_of_the_layer_prices(profile):
    plan = solve(profile, Budget.parse("4x", 400), "moend-greedy", rule="snapkv")
    total = sum(price_config(profile, lp.layer, layer_config(lp, 300), budget=300).loss for lp in plan.layers)
    assert predicted.profile_loss(plan, profile, 300) == pytest.approx(total)
    assert predicted.profile_loss(plan, profile, 400) == pytest.approx(plan.provenance.predicted_loss)


def test_no_gap_to_the_optimum_across_context_lengths(tmp_path, profile):
    plan = solve(profile, Budget.parse("4x", 400), "exact")
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "x",
              "spec": {"name": "t", "context_tokens": 200}},
             {"kind": "policy", "policy": "exact@4x", "method": "exact", "budget": "4x", "role": "",
              "solver": "exact", "plan": plan_dict(plan)}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (row,) = predicted.loss_vs_exact(Results.load(str(path)), "4x", profile)
    assert row["gap"] is None and row["exact_same_rules"] is None
    assert row["skipped"].startswith("solved for a 400-token context, the study's is 200")
