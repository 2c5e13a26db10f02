"""The demo is the example study: the spec in examples/ and the one `polykv demo` runs cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

from polykv.commands.demo import DEMO_SPEC, demo_spec
from polykv.registry import get_registry
from polykv.profiling import stats

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "demo_study.json"


def test_the_example_file_is_the_demo_spec():
    assert json.loads(EXAMPLE.read_text()) == DEMO_SPEC


def test_the_demo_covers_the_moend_chain_a_route_and_two_budgets_one_at_least_8x():
    roles = {s.get("role", s["name"]) for s in DEMO_SPEC["solvers"]}
    assert {"1d", "2d_uniform", "2d", "2d_hetero", "routed_uniform"} <= roles
    assert any(s["solver"] == "profile-route" for s in DEMO_SPEC["solvers"])
    ratios = [float(b.rstrip("x")) for b in DEMO_SPEC["budgets"]]
    assert len(ratios) >= 2 and max(ratios) >= 8
    assert DEMO_SPEC["tasks"][0]["task"] == "passkey" and DEMO_SPEC["tasks"][0]["samples"] >= 20
    registry = get_registry()
    for s in DEMO_SPEC["solvers"]:
        registry.solver(s["solver"])(registry=registry).params(s["params"])  # every parameter is known
    # 20 items separate a perfect full cache from chance-level retrieval with room to spare:
    assert stats.wilson_interval(20, 20).low > stats.wilson_interval(10, 20).high


def test_demo_spec_overrides_samples_and_profile():
    spec = demo_spec(7, "/x/profile.json")
    assert spec["tasks"][0]["samples"] == 7 and spec["profile"] == "/x/profile.json"
    assert DEMO_SPEC["tasks"][0]["samples"] == 20  # the shared default is not modified


def test_the_demo_budgets_real_bytes_stored_in_16_bits():
    assert DEMO_SPEC["basis"] == "resident" and DEMO_SPEC["storage_dtype"] == "bfloat16"
    spec = demo_spec(3, "/x/profile.json", ["10x", "12x"], "nominal")
    assert spec["budgets"] == ["10x", "12x"] and spec["basis"] == "nominal"


def test_the_demo_runs_the_shipped_kvzip_global_plan_at_each_budget_that_has_one():
    import os

    from polykv.commands.demo import kvzip_plans

    for name, path in DEMO_SPEC["plans"].items():  # the example's relative paths name shipped files
        assert name.startswith("kvzip-global@") and (EXAMPLE.parent / path).is_file(), path
    spec = demo_spec(3, "/x/profile.json", ["8x", "10x"])
    assert list(spec["plans"]) == ["kvzip-global@8x"] and os.path.isabs(spec["plans"]["kvzip-global@8x"])
    assert demo_spec(3, "/x/profile.json", ["8x"], "nominal")["plans"] == {}  # the files are solved on resident bytes
    assert set(kvzip_plans(["4x", "8x"], "resident", "gemma3-270m")) == {"kvzip-global@4x", "kvzip-global@8x"}
