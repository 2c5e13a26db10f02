"""``polykv plan show`` reads right: each layer once, the budget in words, an allocator plan's expected ratio."""

from __future__ import annotations

import json
import re
from pathlib import Path

from polykv.cli import main

ROOT = Path(__file__).resolve().parents[2]
ALLOCATOR_PLAN = ROOT / "bench" / "high_compression" / "plans" / "kvzip-global.8x.plan.json"


def _show(capsys, *args) -> str:
    assert main(["plan", "show", *map(str, args)]) == 0
    return capsys.readouterr().out


def _layer_rows(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if re.match(r"^\d+w?\s", line)]


def test_each_layer_is_listed_once_with_its_bytes(capsys):
    out = _show(capsys, ALLOCATOR_PLAN)
    layers = _layer_rows(out)
    assert layers == [str(i) for i in range(30)]
    header = next(line for line in out.splitlines() if line.startswith("LAYER"))
    assert header.split() == ["LAYER", "PREFILL", "DECODE", "K", "V", "QUANTIZER", "KEPT", "NOMINAL_B", "RESIDENT_B",
                              "METADATA_B"]
    assert "layer  prefill" not in out


def test_budget_is_words_not_a_dict(capsys, tmp_path):
    out = _show(capsys, ALLOCATOR_PLAN)
    assert "budget   8x of the 16-bit cache (resident basis)\n" in out and "{'ratio'" not in out
    raw = json.loads(ALLOCATOR_PLAN.read_text())
    for field in ("basis", "batch", "cache_dtype"):
        raw["provenance"].pop(field)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    assert "budget   8x of the 16-bit cache\n" in _show(capsys, path)


def test_allocator_plan_states_its_expected_ratio_beside_the_bound(capsys, tmp_path):
    out = _show(capsys, ALLOCATOR_PLAN)
    line = next(x for x in out.splitlines() if x.startswith("full cache"))
    bound, expected = (float(x) for x in re.findall(r"([\d.]+)x resident", line))
    # the expected bytes: every allocated layer at its planned capacity, i.e. the same plan without its group
    raw = json.loads(ALLOCATOR_PLAN.read_text())
    raw.pop("allocation")
    unallocated = tmp_path / "no-group.plan.json"
    unallocated.write_text(json.dumps(raw))
    plain = next(x for x in _show(capsys, unallocated).splitlines() if x.startswith("full cache"))
    assert bound == 3.15 and expected == float(re.search(r"compression ([\d.]+)x resident", plain).group(1))
    assert expected > 8.0
    assert "at its allocators' budgets" in line


def test_unrecorded_context_reads_as_a_sentence(capsys, tmp_path):
    raw = json.loads(ALLOCATOR_PLAN.read_text())
    raw["provenance"]["context_tokens"] = None
    raw["provenance"]["budget"] = None
    raw["allocation"] = []
    for layer in raw["layers"]:
        layer["prefill"] = {"rule": "snapkv", "capacity": 100}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    out = _show(capsys, path, "--context", 500)
    assert "budgeted for a context length the plan does not record" in out
    assert "an unrecorded-token" not in out
