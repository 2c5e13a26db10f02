"""Plans with thousands of layers: the pyramid trim and ``plan show`` of an allocation group stay linear.

The pyramid's floor can overshoot its total by up to L (L - 1) / 2 tokens; taking them one at a time from
the largest layer made ``plan show`` of a 5,000-layer ``pyramidkv`` group take 34 s. The trim is checked
against that one-at-a-time definition, and ``plan show``'s work is counted (Python calls) at two sizes.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys

import pytest

from polykv.cli import main
from polykv.solvers.pyramid import trim_to


def _one_at_a_time(caps, total):
    caps, excess = list(caps), sum(caps) - total
    removed = max(excess, 0)
    while excess > 0:
        i = max(range(len(caps)), key=lambda j: (caps[j], -j))
        caps[i] -= 1
        excess -= 1
    return caps, removed


def test_trim_equals_taking_one_token_at_a_time_from_the_largest_layer():
    rng = random.Random(0)
    for _ in range(2000):
        caps = [rng.randint(-3, 40) for _ in range(rng.randint(1, 12))]
        total = rng.randint(-20, sum(caps) + 10)
        assert trim_to(caps, total) == _one_at_a_time(caps, total), (caps, total)


def test_trim_of_a_pyramid_with_ties_keeps_the_lowest_index_first_rule():
    assert trim_to([10, 10, 10, 4], 25) == ([7, 7, 7, 4], 9)
    assert trim_to([10, 10, 10, 4], 26) == ([7, 7, 8, 4], 8)
    assert trim_to([5, 5], 10) == ([5, 5], 0)


def _group_plan(path, layers: int) -> str:
    rows = [{"layer": i, "prefill": {"rule": "pyramidkv", "capacity": 64}, "decode": {"rule": "full"}}
            for i in range(layers)]
    plan = {"schema_version": 1, "model": {"num_layers": layers, "num_kv_heads": 2, "head_dim": 32},
            "provenance": {"context_tokens": 1024}, "layers": rows,
            "allocation": [{"allocator": "pyramidkv", "layers": list(range(layers))}]}
    path.write_text(json.dumps(plan), encoding="utf-8")
    return str(path)


def _calls_to_show(path: str) -> int:
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    main(["plan", "show", path])  # warm: imports and the registry are not the plan's work
    out = io.StringIO()
    sys.setprofile(count)
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["plan", "show", path])
    finally:
        sys.setprofile(None)
    assert rc == 0 and "allocation group pyramidkv[0.." in out.getvalue()
    return calls


def test_plan_show_of_an_allocation_group_does_work_linear_in_its_layers(tmp_path, capsys):
    small = _calls_to_show(_group_plan(tmp_path / "small.json", 150))
    large = _calls_to_show(_group_plan(tmp_path / "large.json", 300))
    capsys.readouterr()
    # linear: 2x the calls; the quadratic trim made it about 4x (and the layer count squared, cubed in time)
    assert large < 2.5 * small, (small, large)


@pytest.mark.parametrize("layers", [10_000])
def test_a_ten_thousand_layer_group_shows_its_rows_and_group_bound(tmp_path, capsys, layers):
    assert main(["plan", "show", _group_plan(tmp_path / "big.json", layers)]) == 0
    out = capsys.readouterr().out
    assert f"allocation group pyramidkv[0..{layers - 1}]" in out and f"\n{layers - 1} " in out
