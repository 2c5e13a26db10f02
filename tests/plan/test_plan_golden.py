"""Golden plan files: valid ones round-trip byte for byte; each invalid one fails naming its field.

``tests/plan/golden/Plan-valid-*.json`` are canonical plan files for a 2-layer model with 2 KV heads of
dimension 16. ``tests/plan/golden/Plan-invalid-*.json`` each break one rule; ``expected-errors.json`` gives,
per file, the dotted field the error must name (null for JSON syntax errors) and a message fragment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers

from polykv.cli import main
from polykv.errors import PlanError
from polykv.models.geometry import geometry_from_config
from polykv.plan import load_plan
from polykv.registry import get_registry

GOLDEN = Path(__file__).resolve().parent / "golden"
VALID = sorted(GOLDEN.glob("Plan-valid-*.json"))
INVALID = sorted(GOLDEN.glob("Plan-invalid-*.json"))
EXPECTED = json.loads((GOLDEN / "expected-errors.json").read_text(encoding="utf-8"))


def _config():
    return transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    hidden_size=64, intermediate_size=128, vocab_size=128)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A local model folder (config.json only) for ``--model FOLDER``: the shape the golden plans are for."""
    folder = tmp_path_factory.mktemp("tiny-model")
    _config().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def geometry():
    return geometry_from_config(_config())


def test_every_invalid_file_has_an_expectation_and_back():
    assert len(VALID) >= 4 and len(INVALID) >= 20
    assert sorted(p.name for p in INVALID) == sorted(EXPECTED)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_plan_round_trips_byte_identically(path, tmp_path, geometry):
    plan = load_plan(str(path), registry=get_registry(), geometry=geometry)
    out = tmp_path / path.name
    plan.save(str(out))
    assert out.read_bytes() == path.read_bytes()
    assert load_plan(str(out)) == plan


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_plan_validates_and_shows_through_the_cli(path, model_folder, capsys):
    assert main(["plan", "validate", str(path), "--model", str(model_folder)]) == 0
    out, err = capsys.readouterr()
    assert "valid plan, 2 layers" in out and err == ""
    has_model = load_plan(str(path)).model is not None
    argv = ["plan", "show", str(path), "--context", "1000"] + ([] if has_model else ["--model", str(model_folder)])
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "context  1000 tokens" in out
    layer_rows = [ln for ln in out.splitlines() if ln.split()[:1] in (["0"], ["1"])]
    assert len(layer_rows) == 2, out  # one table: each layer listed once, with its ops and its bytes


def test_show_needs_a_model_shape(capsys):
    (path,) = [p for p in VALID if "no-model" in p.name]
    assert main(["plan", "show", str(path)]) == 2
    assert "--model" in capsys.readouterr().err


def test_show_resolves_ratio_capacities_at_the_context(capsys):
    (path,) = [p for p in VALID if "mixed" in p.name]
    assert main(["plan", "show", str(path), "--context", "1000"]) == 0
    out = capsys.readouterr().out
    assert "tova@0.25x=250" in out and "h2o@0.5x=500" in out and "snapkv@64" in out


def test_validate_against_a_model_checks_quantizer_groups(tmp_path, model_folder, capsys):
    plan = load_plan(str([p for p in VALID if "mixed" in p.name][0]))
    bad = plan.with_layer(1, quantizer_params={"group_size": 32})  # KIVI groups must divide head_dim 16
    path = tmp_path / "groups.json"
    bad.save(str(path))
    assert main(["plan", "validate", str(path)]) == 0
    capsys.readouterr()
    assert main(["plan", "validate", str(path), "--model", str(model_folder)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "layer 1" in err and "quantizer_params" in err and "Traceback" not in err


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_plan_fails_naming_the_field(path, geometry):
    expected = EXPECTED[path.name]
    with pytest.raises(PlanError) as exc:
        load_plan(str(path), registry=get_registry(), geometry=geometry)
    err = exc.value
    assert err.field == expected["field"], str(err)
    assert expected["message"] in str(err)
    assert err.source == str(path)
    if err.field:
        assert f"field '{err.field}'" in str(err)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
@pytest.mark.parametrize("verb", ["validate", "show"])
def test_cli_exits_2_without_traceback(path, verb, model_folder, capsys):
    rc = main(["plan", verb, str(path), "--model", str(model_folder)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "Traceback" not in err and out == ""
    assert err.startswith(f"polykv plan {verb}: error: ") and str(path) in err
    assert EXPECTED[path.name]["message"] in err


def test_json_syntax_error_gives_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "schema_version": 1,\n  "layers": [\n    {"layer": 0,, }\n  ]\n}\n')
    with pytest.raises(PlanError, match=r"line 4, column 17"):
        load_plan(str(bad))


def test_missing_file_and_non_utf8_are_plan_errors(tmp_path, capsys):
    assert main(["plan", "validate", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    raw = tmp_path / "latin1.json"
    raw.write_bytes(b'{"note": "caf\xe9"}')
    with pytest.raises(PlanError, match="UTF-8"):
        load_plan(str(raw))


def test_a_minimal_hand_written_plan_loads_with_defaults(tmp_path, geometry):
    path = tmp_path / "minimal.json"
    path.write_text(json.dumps({"schema_version": 1, "layers": [
        {"layer": 0, "prefill": {"rule": "full"}, "decode": {"rule": "full"}},
        {"layer": 1, "prefill": {"rule": "tova", "capacity": 32}, "decode": {"rule": "full"}, "k_bits": 8}]}))
    plan = load_plan(str(path), registry=get_registry(), geometry=geometry)
    assert plan.model is None and plan.trigger.decode_slack == 128
    assert plan[1].quantizer == "kivi" and plan[1].v_bits == 16 and plan[0].keeps_everything
    canonical = tmp_path / "canonical.json"
    plan.save(str(canonical))
    assert load_plan(str(canonical)) == plan


def test_the_shipped_plans_folder_holds_only_valid_plans():
    folder = Path(__file__).resolve().parents[2] / "plans"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        load_plan(str(path), registry=get_registry())
    assert os.path.isdir(GOLDEN)
