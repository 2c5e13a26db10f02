"""``refine`` on the profile's objective mix, and from the ``global`` solver's plan (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polykv.profiling import objectives as ob
from polykv.profiling.budget import Budget
from polykv.profiling.plan_meter import PlanMeter, heldout_sequences
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn

T, FOLLOW = 64, 16
PARAMS = {"tokens": T, "follow_up": FOLLOW, "sequences": 2, "steps": 2, "tries": 3}
BUDGET = Budget.parse("2x", T, basis="resident")


@pytest.fixture(scope="module")
def tiny(saved_tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = saved_tiny_model(32)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _profile(model, *, weights=None) -> Profile:
    from polykv.models.geometry import geometry_of_model

    configs = [c for rule in ("pyramidkv", "snapkv") for c in moend_configs(rule, "prefill", keeps=(0.25, 0.5, 1.0),
                                                                           k_bits=(16, 8), v_bits=(16, 8))]
    seen, unique = set(), []
    for c in configs:
        c = c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
        if c.label not in seen:
            seen.add(c.label)
            unique.append(c)
    table = np.random.default_rng(1).random((2, len(unique)))
    prof = Profile.from_table(table, unique, geometry_of_model(model))
    if weights is None:
        return prof
    import attrs

    metrics = {"l2": table, "kl": table, "kl_reconstruction": 2 * table, "kl_mix": table + 2 * weights * table}
    return attrs.evolve(prof, metrics=metrics, routing_metric="kl_mix",
                        objective_weights={"kl": 1.0, "kl_reconstruction": float(weights)})


def test_refine_measures_the_profiles_objective_mix(tiny):
    model, tokenizer = tiny
    prof = _profile(model, weights=3.0)
    plan = solve(prof, BUDGET, "refine", model=MeasureOn(model=model, tokenizer=tokenizer, name="tiny"), **PARAMS)
    rec = plan.provenance.measured
    assert rec["metric"] == "kl_mix" and rec["objectives"] == {"kl": 1.0, "kl_reconstruction": 3.0}
    assert rec["start"] == "exact" and rec["refine_kl"] <= rec["exact_kl"]
    seqs, _ = heldout_sequences(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"], 2, T + FOLLOW, seed=0,
                                profile=prof)
    items = ob.build(("continuation", "reconstruction"), seqs, T, tokenizer=tokenizer)
    assert rec["items"] == sum(len(v) for v in items.values()) > 2
    flat = [(it, {"continuation": 1.0, "reconstruction": 3.0}[k] / len(v)) for k, v in items.items() for it in v]
    independent = PlanMeter(model, [it.ids for it, _ in flat], T, rows=[it.rows for it, _ in flat],
                            weights=[w for _, w in flat], storage_dtype=torch.bfloat16, reuse_prefill=False)
    assert independent.measure(plan) == pytest.approx(rec["refine_kl"], rel=1e-6, abs=1e-9)
    assert "kl_mix KL" in plan.provenance.note


def test_continuation_alone_is_the_plain_held_out_kl(tiny):
    model, tokenizer = tiny
    prof = _profile(model, weights=3.0)
    plan = solve(prof, BUDGET, "refine", model=MeasureOn(model=model, tokenizer=tokenizer), objectives=["continuation"],
                 **PARAMS)
    assert plan.provenance.measured["metric"] == "kl" and "objectives" not in plan.provenance.measured


def test_refine_starts_from_the_global_plan_and_keeps_its_group(tiny):
    model, tokenizer = tiny
    prof = _profile(model)
    start = solve(prof, BUDGET, "global", allocator="pyramidkv")
    assert start.allocation and start.allocation[0].layers
    plan = solve(prof, BUDGET, "refine", model=MeasureOn(model=model, tokenizer=tokenizer), start="global",
                 allocator="pyramidkv", **PARAMS)
    rec = plan.provenance.measured
    assert rec["start"] == "global" and "start_kl" in rec and "exact_kl" not in rec
    assert rec["refine_kl"] <= rec["start_kl"]
    independent = PlanMeter(model, heldout_sequences(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"], 2,
                                                     T + FOLLOW, seed=0, profile=prof)[0], T,
                            storage_dtype=torch.bfloat16, reuse_prefill=False)
    assert independent.measure(start) == pytest.approx(rec["start_kl"], rel=1e-6, abs=1e-9)
    for g in plan.allocation:
        assert g.allocator == "pyramidkv"
        assert all(plan.layers[i].prefill.rule == "pyramidkv" for i in g.layers)
    if not rec["accepted"]:
        assert plan.layers == start.layers and plan.allocation == start.allocation
    assert plan.provenance.predicted_bytes <= BUDGET.to_bytes(prof.model)
