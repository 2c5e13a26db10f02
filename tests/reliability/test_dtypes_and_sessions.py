"""One profile and its plans serve every compute dtype; calibration runs in bfloat16; sessions do not nest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import polykv
from polykv.cli import main
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import fingerprints_match, geometry_of_model, weights_digest
from polykv.plan import OpSpec, load_plan, uniform_plan, validate_plan
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PROFILE = ROOT / "profiles" / "smollm2-135m-instruct.profile.json"


def test_the_weights_digest_does_not_depend_on_the_compute_dtype():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64)
    with torch.no_grad():  # include values that underflow in float16 and overflow nothing
        next(model.parameters()).view(-1)[:4] = torch.tensor([1e-9, -1e-9, 3e-8, -6e-5])
    digests = {dt: weights_digest(model.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(set(digests.values())) == 1
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64, seed=1)
    assert weights_digest(other) != digests[torch.float32]


def test_a_legacy_weights_digest_matches_by_shape_only():
    assert fingerprints_match("cfg-aaaaaaaaaaaa+w-111111111111", "cfg-aaaaaaaaaaaa+s-222222222222")
    assert not fingerprints_match("cfg-aaaaaaaaaaaa+s-111111111111", "cfg-aaaaaaaaaaaa+s-222222222222")
    assert not fingerprints_match("cfg-aaaaaaaaaaaa+w-111111111111", "cfg-bbbbbbbbbbbb+s-111111111111")


def test_a_plan_made_in_float32_runs_in_bfloat16():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32, vocab=64)
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=16), k_bits=8, v_bits=4)
    model = model.to(torch.bfloat16)
    validate_plan(plan, registry=get_registry(), geometry=geometry_of_model(model))
    ids = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(ids)
        assert out.logits.dtype == torch.bfloat16 and session.cache.stored_tokens() == [16, 16]


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_shipped_profile_and_plans_accept_smollm2_in_16_bit_dtypes(dtype):
    from polykv.models import load_default_model

    model, _ = load_default_model(dtype=dtype)
    geo = geometry_of_model(model)
    load_profile(str(SHIPPED_PROFILE)).check_model(geo)
    for path in sorted((ROOT / "plans").glob("smollm2-*.plan.json")):
        load_plan(str(path), registry=get_registry(), geometry=geo)
    assert load_profile(str(SHIPPED_PROFILE)).provenance.dtype == "float32"


@pytest.fixture(scope="module")
def model_dir(saved_tiny_model):
    return saved_tiny_model(16)


def test_calibration_runs_in_bfloat16_records_it_and_serves_float32(model_dir, tmp_path, capsys):
    out = str(tmp_path / "bf16.profile.json")
    argv = ["calibrate", model_dir, "-o", out, "--sequences", "1", "--tokens", "48", "--prefix", "32",
            "--rules", "tova", "--keeps", "0.5,1.0", "--bits", "16,8", "--stat-capacity", "8", "--no-progress"]
    assert main(argv) == 2  # head_dim 16 cannot hold KIVI's default groups of 32 channels
    assert "group_size" in capsys.readouterr().err and not os.path.exists(out)
    assert main(argv + ["--dtype", "bf16", "--quantizer-param", "group_size=16"]) == 0, capsys.readouterr().err
    prof = load_profile(out)
    assert prof.provenance.dtype == "bfloat16"
    import transformers

    f32 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prof.check_model(geometry_of_model(f32))  # measured in bfloat16, the same model in float32


def test_sessions_on_one_model_do_not_nest_and_the_outer_one_survives_the_refusal():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64)
    geo = geometry_of_model(model)
    outer, inner = uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=8)), uniform_plan(geo)
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    early = polykv.apply(model, inner)  # made before the outer block starts: refused when it enters
    with torch.no_grad(), polykv.apply(model, outer) as session:
        with pytest.raises(RuntimeConfigError, match="already inside a"):
            with polykv.apply(model, inner):
                pass
        with pytest.raises(RuntimeConfigError, match="already inside a"):
            with early:
                pass
        session.prefill(ids)
        assert session.cache.stored_tokens() == [8, 8]  # the outer session still runs its plan
    with polykv.apply(model, inner):  # after the outer block, a new session is fine
        pass


def test_an_empty_prompt_is_named_as_such():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64)
    with polykv.apply(model, uniform_plan(geometry_of_model(model))) as session:
        with pytest.raises(RuntimeConfigError, match="no tokens"):
            session.prefill(torch.zeros(1, 0, dtype=torch.long))
