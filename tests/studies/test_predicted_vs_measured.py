"""``polykv report``: Spearman of the profile-predicted loss against measured accuracy, per task and budget."""

from __future__ import annotations

import itertools
import json

import attrs
import numpy as np
import pytest

from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers.exact import Exact
from polykv.studies import predicted
from polykv.studies.report import write_report
from polykv.studies.results import FORMAT, Results

T = 100


def _profile() -> Profile:
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    table = np.random.default_rng(5).random((2, len(configs)))
    return Profile.from_table(table, configs, (2, 2, 32))


def _plan(profile, cols, loss):
    s = Exact()
    layers = [s.layer_entry(profile.configs[c], profile=profile) for c in cols]
    return s.plan(profile, Budget.parse("1x", T, basis="resident"), layers, {}, predicted_loss=loss, predicted_bits=0)


def _rank(values):
    """1-based ranks of distinct values."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) + 1 for i in range(len(values))]


def _hand_spearman(x, y) -> float:
    """rho = 1 - 6 sum d^2 / (n (n^2 - 1)), valid without ties."""
    n = len(x)
    d2 = sum((a - b) ** 2 for a, b in zip(_rank(x), _rank(y)))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _write(path, profile, plans: dict, accuracy: dict, items: int = 20):
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "spec-x",
              "spec": {"name": "hand", "context_tokens": T}}]
    lines.append({"kind": "policy", "policy": "full", "method": "full", "budget": None, "role": "full",
                  "plan": None, "nominal_bytes": None})
    for name, plan in plans.items():
        lines.append({"kind": "policy", "policy": name, "method": name.split("@")[0], "budget": "8x", "role": "",
                      "plan": json.loads(plan.to_json()), "nominal_bytes": None})
    for name, acc in list(accuracy.items()) + [("full", 1.0)]:
        hits = int(round(acc * items))
        for i in range(items):
            lines.append({"kind": "result", "policy": name, "task": "passkey", "item": f"passkey-{i}",
                          "score": float(i < hits), "kv_bytes": 100, "full_kv_bytes": 1000, "context_tokens": T})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture()
def study(tmp_path):
    profile = _profile()
    table = profile.table()
    pairs = list(itertools.product(range(len(profile.configs)), repeat=2))
    rng = np.random.default_rng(0)
    chosen = [pairs[i] for i in rng.choice(len(pairs), 13, replace=False)]
    plans, want_loss = {}, {}
    for k, cols in enumerate(chosen):
        loss = float(table[0, cols[0]] + table[1, cols[1]])
        if k % 3 == 0:  # no loss recorded: the report computes it from the profile
            plans[f"p{k}@8x"] = _plan(profile, cols, None)
        elif k % 3 == 1:  # the solver's own prediction, from this profile: taken as recorded
            loss = 10 + k
            plans[f"p{k}@8x"] = _plan(profile, cols, loss)
        else:  # recorded from another profile: recomputed from this one
            plan = _plan(profile, cols, 50.0)
            plans[f"p{k}@8x"] = attrs.evolve(plan, provenance=attrs.evolve(plan.provenance,
                                                                           profile_fingerprint="other"))
        want_loss[f"p{k}@8x"] = loss
    accuracy = {name: (i + 1) / 20 for i, name in enumerate(rng.permutation(list(plans)))}
    path = tmp_path / "results.jsonl"
    _write(path, profile, plans, accuracy)
    prof_path = tmp_path / "p.profile.json"
    profile.save(str(prof_path))
    return path, prof_path, profile, want_loss, accuracy


def test_spearman_equals_the_hand_computation(study):
    path, _, profile, want_loss, accuracy = study
    pvm = predicted.predicted_vs_measured(Results.load(str(path)), "passkey", "8x", profile)
    got = {r["policy"]: r for r in pvm["rows"]}
    for name, loss in want_loss.items():
        assert got[name]["loss"] == pytest.approx(loss)
        assert got[name]["accuracy"] == pytest.approx(accuracy[name])
    names = sorted(want_loss)
    rho = _hand_spearman([want_loss[n] for n in names], [accuracy[n] for n in names])
    assert pvm["n"] == 13 and pvm["spearman"].r == pytest.approx(rho)


def test_report_prints_rho_and_n(study, tmp_path):
    path, prof_path, profile, want_loss, accuracy = study
    write_report(str(path), str(tmp_path / "out"), profile_path=str(prof_path))
    md = (tmp_path / "out" / "report.md").read_text()
    names = sorted(want_loss)
    rho = _hand_spearman([want_loss[n] for n in names], [accuracy[n] for n in names])
    assert f"measured score the accuracy, over n = 13 plans: {rho:+.3f} (one-sided" in md
    assert "Spearman rho(predicted loss, measured score): negative = the prediction ranks the plans correctly" in md
    assert "< 12" not in md


def test_fewer_than_12_plans_are_flagged(study, tmp_path):
    path, prof_path, profile, want_loss, accuracy = study
    res = Results.load(str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    keep = set(sorted(want_loss)[:5])
    lines = [x for x in lines if x.get("policy") in keep | {"full"} or x["kind"] == "header"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(x) + "\n" for x in lines))
    write_report(str(small), str(tmp_path / "out2"), profile_path=str(prof_path))
    md = (tmp_path / "out2" / "report.md").read_text()
    assert "over n = 5 plans" in md and "(n = 5 < 12: fewer plans" in md
    assert res.policies  # the full file still loads


def test_profile_loss_is_none_for_a_setting_the_profile_lacks():
    profile = _profile()
    plan = _plan(profile, [0, 1], None)
    assert predicted.profile_loss(plan, profile, T) == pytest.approx(profile.table()[0, 0] + profile.table()[1, 1])
    below = plan.with_layer(1, prefill=attrs.evolve(plan.layers[0].prefill, capacity_ratio=0.1))
    assert predicted.profile_loss(below, profile, T) is None  # below the lowest profiled keep (0.25)
    other = plan.with_layer(1, prefill=attrs.evolve(plan.layers[0].prefill, rule="tova"))
    assert predicted.profile_loss(other, profile, T) is None  # a rule the profile never measured
    widths = attrs.evolve(plan, layers=(plan.layers[0], attrs.evolve(plan.layers[1], k_bits=4)))
    assert predicted.profile_loss(widths, profile, T) is None  # widths it never measured


def test_profile_loss_interpolates_a_keep_between_profiled_keeps():
    """A keep the profile did not measure (30 of 100 tokens) is priced as the uniform solver prices its own
    plans: linearly between the profiled keeps around it (0.25 and 0.5), at the layer's widths."""
    profile = _profile()
    table = profile.table()
    col = {(c.rule, c.keep, c.k_bits, c.v_bits): j for j, c in enumerate(profile.configs)}
    plan = _plan(profile, [col[("snapkv", 0.25, 16, 8)], col[("snapkv", 0.5, 8, 16)]], None)
    moved = plan.with_layer(1, prefill=attrs.evolve(plan.layers[1].prefill, capacity_ratio=0.3, capacity=None))
    lo, hi = table[1, col[("snapkv", 0.25, 8, 16)]], table[1, col[("snapkv", 0.5, 8, 16)]]
    want = table[0, col[("snapkv", 0.25, 16, 8)]] + 0.8 * lo + 0.2 * hi
    assert predicted.profile_loss(moved, profile, T) == pytest.approx(want)
    top = plan.with_layer(1, prefill=attrs.evolve(plan.layers[1].prefill, capacity_ratio=0.75, capacity=None))
    full = table[1, col[("full", 1.0, 8, 16)]]  # the keep-everything config at the same widths closes the range
    assert predicted.profile_loss(top, profile, T) == pytest.approx(
        table[0, col[("snapkv", 0.25, 16, 8)]] + 0.5 * hi + 0.5 * full)


def test_a_profile_extending_the_plans_profile_keeps_their_recorded_losses(study):
    from polykv.profiling.merge import merge_profiles

    path, _, profile, want_loss, _ = study
    extra_cfg = [CandidateConfig(rule="tova", keep=0.25, phase="prefill")]
    extra = Profile.from_table(np.full((2, 1), 0.5), extra_cfg, (2, 2, 32))
    extended = merge_profiles(profile, extra)
    assert extended.provenance.extends == (profile.fingerprint,) and extended.fingerprint != profile.fingerprint
    got = {r["policy"]: r for r in predicted.predicted_vs_measured(Results.load(str(path)), "passkey", "8x",
                                                                  extended)["rows"]}
    for k, name in enumerate(sorted(want_loss, key=lambda n: int(n[1:].split("@")[0]))):
        assert got[name]["loss"] == pytest.approx(want_loss[name])  # recorded from the base: kept; else recomputed
    assert Profile.from_table(np.zeros((2, 1)), extra_cfg, (2, 2, 32)).provenance.extends == ()


def test_a_plan_file_policy_counts_at_the_budget_its_plan_names(study, tmp_path):
    from polykv.studies.results import budget_label

    path, _, profile, want_loss, _ = study
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    name = sorted(want_loss)[0]
    for x in lines:
        if x.get("kind") == "policy" and x["policy"] == name:
            x["budget"] = None  # a plan file in the spec: no solver budget recorded
            x["plan"]["provenance"]["budget"] = {"ratio": 8.0}
    other = tmp_path / "plans.jsonl"
    other.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = Results.load(str(other))
    assert res.policies[name]["budget"] == "8x" and res.policies["full"]["budget"] is None
    assert name in {r["policy"] for r in predicted.predicted_vs_measured(res, "passkey", "8x", profile)["rows"]}
    assert [budget_label(b) for b in ({"ratio": 12.0}, {"ratio": 2.5}, {"bytes": 1000}, {"tokens": 400}, None,
                                      {"ratio": True})] == ["12x", "2.5x", "1000", "400tok", None, None]


def test_a_policy_running_the_same_plan_as_another_is_counted_once(tmp_path):
    """A solver that kept its starting plan (refine finding no better move) runs the same plan as that solver's
    policy: the report lists both but counts the plan once, so n counts distinct plans."""
    profile = _profile()
    plans = {f"p{k}@8x": _plan(profile, cols, None) for k, cols in enumerate([(0, 1), (1, 2), (2, 0), (3, 1)])}
    same = plans["p1@8x"]
    plans["kept@8x"] = attrs.evolve(same, provenance=attrs.evolve(same.provenance, solver="refine", note="kept"))
    accuracy = {"p0@8x": 0.2, "p1@8x": 0.4, "p2@8x": 0.6, "p3@8x": 0.8, "kept@8x": 0.4}
    path = tmp_path / "results.jsonl"
    _write(path, profile, plans, accuracy)
    pvm = predicted.predicted_vs_measured(Results.load(str(path)), "passkey", "8x", profile)
    rows = {r["policy"]: r for r in pvm["rows"]}
    assert rows["kept@8x"]["same_plan_as"] == "p1@8x" and rows["p1@8x"]["same_plan_as"] is None
    assert pvm["n"] == 4
    prof_path = tmp_path / "p.profile.json"
    profile.save(str(prof_path))
    write_report(str(path), str(tmp_path / "out"), profile_path=str(prof_path))
    md = (tmp_path / "out" / "report.md").read_text()
    assert "over n = 4 plans" in md and "the same plan as p1@8x, counted once" in md
