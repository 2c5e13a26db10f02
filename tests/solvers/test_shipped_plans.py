"""Shipped plans: resident-basis plans hold what their budget says (memory model, 16-bit storage, metadata in),
nominal ones say so in their names, and every capacity is a ratio of the context."""

from __future__ import annotations

import glob
import pathlib

import pytest

from polykv.memory import full_cache_bytes_16bit, held_bytes_per_layer, nominal_bytes
from polykv.plan import load_plan

PLANS = sorted(glob.glob(str(pathlib.Path(__file__).resolve().parents[2] / "plans" / "smollm2-*.plan.json")))


def test_both_bases_are_shipped():
    assert any(p.endswith("-nominal.plan.json") for p in PLANS)
    assert any(not p.endswith("-nominal.plan.json") for p in PLANS)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: pathlib.Path(p).name)
def test_a_shipped_plan_holds_its_budget_on_its_basis(path):
    plan = load_plan(path)
    prov = plan.provenance
    T, ratio = prov.context_tokens, prov.budget["ratio"]
    budget = full_cache_bytes_16bit(plan.model, T) / ratio
    assert all(op.capacity is None for lp in plan.layers for op in (lp.prefill, lp.decode)), "ratios only"
    if path.endswith("-nominal.plan.json"):
        assert prov.basis == "nominal"
        assert 0.97 * budget <= sum(nominal_bytes(plan, None, T, phase="decode")) <= budget
    else:
        assert prov.basis == "resident" and prov.cache_dtype == "bfloat16" and prov.batch == 1
        held = sum(held_bytes_per_layer(plan, None, T, dtype_bytes=2))
        assert held == prov.predicted_bytes
        assert 0.97 * budget <= held <= budget, f"{held / budget:.4f} of the budget"


def test_shipped_plans_name_the_data_their_rules_read():
    """Every shipped plan with a rule that reads per-model data names the shipped file that holds it (as
    ``polykv solve`` records the profile's side file), and no other plan names any."""
    from polykv.contract.model_data import needs_of_rules
    from polykv.registry import get_registry

    registry = get_registry()
    profiles = pathlib.Path(PLANS[0]).resolve().parents[1] / "profiles"
    with_data = 0
    for path in PLANS:
        plan = load_plan(path)
        keys = {n.key for n in needs_of_rules(registry, sorted(plan.rules_used()))}
        assert set(plan.model_data) == keys, pathlib.Path(path).name
        for key, file in plan.model_data.items():
            assert pathlib.Path(file) == profiles / "smollm2-135m-instruct.qstats.safetensors"
            assert pathlib.Path(file).is_file()
        with_data += bool(keys)
    assert with_data >= 4


def test_solve_records_the_profiles_side_file(tmp_path):
    from polykv.cli import main

    root = pathlib.Path(PLANS[0]).resolve().parents[1]
    out = tmp_path / "p.plan.json"
    assert main(["solve", str(root / "profiles" / "smollm2-135m-instruct.profile.json"), "--budget", "8x",
                 "--context", "4096", "--solver", "moend-greedy", "--param", "rule=triattention",
                 "-o", str(out)]) == 0
    assert load_plan(str(out)).model_data == {
        "triattention": str(root / "profiles" / "smollm2-135m-instruct.qstats.safetensors")}
    assert main(["solve", str(root / "profiles" / "smollm2-135m-instruct.profile.json"), "--budget", "8x",
                 "--context", "4096", "--solver", "moend-greedy", "--param", "rule=snapkv",
                 "-o", str(out)]) == 0
    assert load_plan(str(out)).model_data == {}
