"""``refine``: the exact plan improved by moves measured end to end on held-out sequences (tiny model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polykv.cli import main
from polykv.plan import load_plan
from polykv.profiling import validation as val
from polykv.profiling.budget import Budget
from polykv.profiling.plan_meter import PlanMeter, calibration_draw, heldout_sequences
from polykv.profiling.profile import CandidateConfig, Profile, ProfileProvenance, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn
from polykv.solvers.refine_moves import menu_neighbours, ranked_moves

T, FOLLOW = 64, 16
PARAMS = {"tokens": T, "follow_up": FOLLOW, "sequences": 2, "steps": 3, "tries": 4}


@pytest.fixture(scope="module")
def tiny(saved_tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = saved_tiny_model(32)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def _configs():
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 0.75, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    return configs + moend_configs("tova", "prefill", keeps=(0.25, 0.5, 0.75), k_bits=(16, 8), v_bits=(16, 8))


@pytest.fixture(scope="module")
def profile(tiny):
    from polykv.models.geometry import geometry_of_model

    configs = _configs()  # a profile that is wrong on purpose: it predicts less loss for less memory
    wrong = np.array([c.keep + (c.k_bits + c.v_bits) / 64 for c in configs])
    table = wrong + 0.01 * np.random.default_rng(0).random((2, len(configs)))
    return Profile.from_table(table, configs, geometry_of_model(tiny[1]))


BUDGET = Budget.parse("2x", T, basis="resident")


@pytest.fixture(scope="module")
def refined(tiny, profile):
    return solve(profile, BUDGET, "refine", model=MeasureOn(model=tiny[1], tokenizer=tiny[2], name="tiny"), **PARAMS)


def _tokenize(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def independent(tiny, profile):
    """Measured KL of a plan, prefilled by the plan itself (no snapshot) on the solver's held-out sequences."""
    import torch

    seqs, _ = heldout_sequences(_tokenize(tiny[2]), PARAMS["sequences"], T + FOLLOW, seed=0, profile=profile)
    meter = PlanMeter(tiny[1], seqs, T, storage_dtype=torch.bfloat16, reuse_prefill=False)
    return meter.measure


def _replay(profile, exact_plan, steps, upto: int):
    """The exact plan's columns with the accepted moves of ``steps[:upto]`` applied, then ``steps[upto]``'s."""
    labels = {c.label: i for i, c in enumerate(profile.configs)}
    cols = [_column(profile, lp) for lp in exact_plan.layers]
    for s in steps[:upto]:
        if s["accepted"]:
            for m in s["move"]:
                cols[m["layer"]] = labels[m["to"]]
    cand = list(cols)
    for m in steps[upto]["move"]:
        assert profile.configs[cols[m["layer"]]].label == m["from"]
        cand[m["layer"]] = labels[m["to"]]
    return cand


def _column(profile, lp) -> int:
    op = lp.prefill
    for i, c in enumerate(profile.configs):
        if (c.k_bits, c.v_bits) != (lp.k_bits, lp.v_bits):
            continue
        if op.keeps_everything and c.keeps_everything:
            return i
        if not op.keeps_everything and c.rule == op.rule and abs(c.keep - op.capacity_ratio) < 1e-9:
            return i
    raise AssertionError(f"layer {lp.layer} matches no config")


def _plan(profile, cols, budget=BUDGET):
    from polykv.solvers.refine import Refine

    s = Refine()
    layers = [s.layer_entry(profile.configs[c], profile=profile) for c in cols]
    return s.plan(profile, budget, layers, {}, predicted_loss=None, predicted_bits=0)


def test_refine_never_ends_worse_than_exact_and_both_are_measured_as_recorded(refined, profile, independent):
    m = refined.provenance.measured
    assert m["refine_kl"] <= m["exact_kl"]
    assert m["accepted"] >= 1 and m["refine_kl"] < m["exact_kl"]  # the profile is wrong here
    exact = solve(profile, BUDGET, "exact")
    assert independent(exact) == pytest.approx(m["exact_kl"], rel=1e-5)
    assert independent(refined) == pytest.approx(m["refine_kl"], rel=1e-5)
    assert refined.provenance.predicted_loss == pytest.approx(
        sum(profile.table()[lp.layer, _column(profile, lp)] for lp in refined.layers))


def test_refine_never_exceeds_the_budget(refined, profile):
    from polykv import get_registry

    limit = BUDGET.to_bits(profile.model)
    assert sum(BUDGET.layer_bits(profile.model, lp, get_registry()) for lp in refined.layers) <= limit
    assert refined.provenance.predicted_bytes <= BUDGET.to_bytes(profile.model)
    assert all(s["predicted_bytes"] <= limit // 8 for s in refined.provenance.measured["steps"])


def test_every_measured_step_is_recorded_and_reproduces(refined, profile, independent):
    m = refined.provenance.measured
    steps = m["steps"]
    assert m["measured"] == len(steps) + 1 and m["accepted"] == sum(s["accepted"] for s in steps)
    exact = solve(profile, BUDGET, "exact")
    current = m["exact_kl"]
    for i, s in enumerate(steps):
        cols = _replay(profile, exact, steps, i)
        assert independent(_plan(profile, cols)) == pytest.approx(s["measured_kl"], rel=1e-5)
        assert s["predicted_loss"] == pytest.approx(sum(profile.table()[l, c] for l, c in enumerate(cols)))
        assert s["accepted"] == (s["measured_kl"] < current)
        current = s["measured_kl"] if s["accepted"] else current
    assert current == m["refine_kl"]
    final = _replay(profile, exact, steps + [{"move": [], "accepted": False}], len(steps))
    assert [_column(profile, lp) for lp in refined.layers] == final


def test_refine_is_deterministic_and_its_plan_file_keeps_the_record(refined, tiny, profile, tmp_path):
    again = solve(profile, BUDGET, "refine", model=MeasureOn(model=tiny[1], tokenizer=tiny[2], name="tiny"),
                  **PARAMS)
    strip = lambda m: {k: v for k, v in m.items() if k != "seconds"}  # noqa: E731
    assert again.layers == refined.layers
    assert strip(again.provenance.measured) == strip(refined.provenance.measured)
    path = str(tmp_path / "r.plan.json")
    refined.save(path)
    assert load_plan(path).provenance.measured == json.loads(json.dumps(refined.provenance.measured))


def test_step_limit_and_no_steps(tiny, profile):
    on = MeasureOn(model=tiny[1], tokenizer=tiny[2])
    one = solve(profile, BUDGET, "refine", model=on, **{**PARAMS, "steps": 1})
    assert one.provenance.measured["accepted"] <= 1
    none = solve(profile, BUDGET, "refine", model=on, **{**PARAMS, "steps": 0})
    assert none.layers == solve(profile, BUDGET, "exact").layers
    assert none.provenance.measured["steps"] == [] and none.provenance.measured["refine_kl"] == \
        none.provenance.measured["exact_kl"]


def test_validation_sequences_are_apart_from_the_search_and_measured_as_recorded(tiny, profile):
    import torch

    on = MeasureOn(model=tiny[1], tokenizer=tiny[2])
    plan = solve(profile, BUDGET, "refine", model=on, **{**PARAMS, "validate": 2})
    m = plan.provenance.measured
    assert m["sequences"] == 2 and m["validation"]["sequences"] == 2
    seqs, _ = heldout_sequences(_tokenize(tiny[2]), 4, T + FOLLOW, seed=0, profile=profile)
    search = PlanMeter(tiny[1], seqs[:2], T, storage_dtype=torch.bfloat16, reuse_prefill=False)
    check = PlanMeter(tiny[1], seqs[2:], T, storage_dtype=torch.bfloat16, reuse_prefill=False)
    exact = solve(profile, BUDGET, "exact")
    assert search.measure(exact) == pytest.approx(m["exact_kl"], rel=1e-5)
    assert search.measure(plan) == pytest.approx(m["refine_kl"], rel=1e-5)
    assert check.measure(exact) == pytest.approx(m["validation"]["exact_kl"], rel=1e-5)
    assert check.measure(plan) == pytest.approx(m["validation"]["refine_kl"], rel=1e-5)
    assert "on 2 further sequences" in plan.provenance.note


def test_meter_with_reuse_equals_plan_logprobs(tiny, profile):
    seqs, _ = heldout_sequences(_tokenize(tiny[2]), 2, T + FOLLOW, seed=3, profile=profile)
    from polykv.solvers.refine import Refine

    menu = [Refine().config_layer(c, profile=profile) for c in profile.configs]
    meter = PlanMeter(tiny[1], seqs, T, layer_menu=menu)
    for cols in ([0, 5], [9, 2], [14, 20]):
        plan = _plan(profile, cols, Budget.parse("1x", T, basis="resident"))
        want = np.mean([val.kl_divergence(val.reference_logprobs(tiny[1], s, T)[1:],
                                          val.plan_logprobs(tiny[1], plan, s, T)[1:]) for s in seqs])
        assert meter.measure(plan) == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert meter.prefills == len(seqs)  # one prefill per sequence: the menu's states were all recorded


def test_meter_takes_a_menu_of_probe_rules_with_list_parameters(tiny, profile):
    """A kvzip setting (its token-id parameters are lists) in the menu: listed once, measured as without reuse."""
    from polykv.plan import LayerPlan, OpSpec
    import polykv

    seqs, _ = heldout_sequences(_tokenize(tiny[2]), 1, T + FOLLOW, seed=3, profile=profile)
    params = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 16}
    kvzip = LayerPlan(layer=0, prefill=OpSpec(rule="kvzip", capacity=T // 2, params=params), decode=OpSpec(rule="full"))
    menu = [kvzip, kvzip, LayerPlan(layer=0)]
    meter = PlanMeter(tiny[1], seqs, T, layer_menu=menu)
    assert len(meter.layer_menu) == 2
    from polykv.models.geometry import geometry_of_model

    plan = polykv.uniform_plan(geometry_of_model(tiny[1]), prefill=kvzip.prefill, decode="full")
    alone = PlanMeter(tiny[1], seqs, T, reuse_prefill=False)
    assert meter.measure(plan) == pytest.approx(alone.measure(plan), rel=1e-6, abs=1e-12)


def test_heldout_sequences_leave_out_the_profile_calibration_draw(tiny, profile):
    import attrs

    from polykv.profiling.calibrate_settings import corpus_sequences

    tok = _tokenize(tiny[2])
    cal, desc = corpus_sequences(tok, 3, 80, seed=0)
    calibrated = attrs.evolve(profile, provenance=ProfileProvenance(corpus=desc, seed=0, context_tokens=64))
    draw = calibration_draw(calibrated)
    assert (draw.kind, draw.seed, draw.sequences, draw.tokens) == ("mixed", 0, 3, 80)
    got, note = heldout_sequences(tok, 3, 80, seed=0, profile=calibrated)
    raw, _ = corpus_sequences(tok, 6, 80, seed=0)  # what it draws: 3 more than it needs
    seen = [any(bool((r == c).all()) for c in cal) for r in raw]
    assert sum(seen) >= 1 and f"{sum(seen)} of the draw were" in note  # the same seed shares texts
    want = [r for r, s in zip(raw, seen) if not s][:3]
    assert len(got) == 3 and all(bool((g == w).all()) for g, w in zip(got, want))
    assert not any(bool((g == c).all()) for g in got for c in cal)
    plain, _ = heldout_sequences(tok, 3, 80, seed=0, profile=profile)  # no draw recorded: nothing left out
    assert all(bool((g == c).all()) for g, c in zip(plain, cal))


def test_ranked_moves_fit_and_come_best_gain_per_bit_first():
    rng = np.random.default_rng(1)
    configs = _configs()
    table = rng.random((4, len(configs)))
    bits = np.array([int(1000 * c.keep * (c.k_bits + c.v_bits)) for c in configs], dtype=np.int64)
    nbrs = menu_neighbours(configs)
    choice = [1, 4, 9, 20]
    used = int(bits[choice].sum())
    cap = used + 3000
    moves = ranked_moves(table, bits, choice, cap, nbrs, set(range(len(configs))))
    keys = []
    for move in moves:
        cand = list(choice)
        for l, c in move:
            assert c in nbrs[choice[l]]
            cand[l] = c
        assert int(bits[cand].sum()) <= cap
        dl = sum(table[l, c] - table[l, choice[l]] for l, c in move)
        up = max([int(bits[c]) - int(bits[choice[l]]) for l, c in move] + [1])
        keys.append(-dl / up)
    assert keys == sorted(keys, reverse=True)
    singles = {m for m in moves if len(m) == 1}
    want = {((l, n),) for l, c in enumerate(choice) for n in nbrs[c] if used - bits[c] + bits[n] <= cap}
    assert singles == want


def test_menu_neighbours_are_one_step_away():
    configs = _configs()
    nbrs = menu_neighbours(configs)
    label = {c.label: i for i, c in enumerate(configs)}
    got = {configs[j].label for j in nbrs[label["snapkv@0.5/prefill/K8V16"]]}
    assert got == {"snapkv@0.25/prefill/K8V16", "snapkv@0.75/prefill/K8V16", "snapkv@0.5/prefill/K16V16",
                   "snapkv@0.5/prefill/K8V8", "tova@0.5/prefill/K8V16"}
    top = {configs[j].label for j in nbrs[label["tova@0.75/prefill/K16V16"]]}
    assert "full@1/both/K16V16" in top and "tova@0.5/prefill/K16V16" in top


def test_cli_refine_on_a_model_folder(tiny, profile, tmp_path, capsys):
    path = str(tmp_path / "tiny.profile.json")
    profile.save(path)
    out = str(tmp_path / "refine.plan.json")
    rc = main(["solve", path, "--budget", "2x", "--context", str(T), "--solver", "refine", "--model", tiny[0],
               "--tokens", str(T), "--param", f"follow_up={FOLLOW}", "--param", "sequences=2", "--param", "steps=3",
               "--param", "tries=4", "-o", out])
    text = capsys.readouterr().out
    assert rc == 0 and "(exact) ->" in text
    plan = load_plan(out)
    assert plan.provenance.solver == "refine" and plan.provenance.measured["context_tokens"] == T
    assert plan.provenance.measured["model"] == tiny[0]
