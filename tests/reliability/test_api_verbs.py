"""The verbs and calls that load or run a model, through the Python API and the command line: generate modes a plan
cannot serve, devices and dtypes, model folders polykv cannot load, caches it cannot write (the run goes on), a
study's full baseline, RoPE frequencies held in bfloat16 or float16, and ``model-data`` for every key it lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import polykv
import polykv.contract.model_data as model_data_module
from polykv.cli import main
from polykv.commands.model_data import known_needs
from polykv.errors import CacheWriteWarning, PolykvError, ProfileError, RuntimeConfigError
from polykv.models.devices import check_device
from polykv.models.geometry import geometry_of_model
from polykv.models.local_folder import load_by_name
from polykv.adapters.rules.query_stats import compute_query_stats
from polykv.registry import get_registry
from polykv.testing import tiny_model, token_ids

REAL_CACHE_DIR = model_data_module.cache_dir
"""The cache folder as polykv chooses it ($POLYKV_CACHE), before the suite points it at a temp folder."""
ROOT = Path(__file__).resolve().parents[2]


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert isinstance(exc, PolykvError) and "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _compressing_plan(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill=polykv.OpSpec(rule="snapkv", capacity=8),
                               decode="full")


# -- generate modes a plan cannot serve -------------------------------------------------------------------
MODES = [("assistant_model", lambda: tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)),
         ("prompt_lookup_num_tokens", lambda: 3), ("assistant_early_exit", lambda: 1),
         ("cache_implementation", lambda: "static"), ("cache_implementation", lambda: "dynamic"),
         ("num_beams", lambda: 2)]


@pytest.mark.parametrize("name,value", MODES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(MODES)])
def test_a_generate_mode_a_plan_cannot_serve_is_refused_before_the_model_runs(model, forwards, name, value):
    with polykv.apply(model, _compressing_plan(model)):
        with pytest.raises(RuntimeConfigError) as err:
            model.generate(token_ids(1, 12), max_new_tokens=2, do_sample=False, **{name: value()})
    msg = _one_line(err.value)
    assert name in msg and "polykv" in msg and ("outside" in msg or "num_beams=1" in msg)
    assert forwards == []


@pytest.mark.parametrize("name,value", [("prompt_lookup_num_tokens", 3), ("cache_implementation", "static"),
                                        ("num_beams", 2)])
def test_the_same_modes_set_in_the_generation_config_are_refused(model, forwards, name, value):
    saved = model.generation_config
    model.generation_config = type(saved)(**{name: value})
    try:
        with polykv.apply(model, _compressing_plan(model)):
            with pytest.raises(RuntimeConfigError) as err:
                model.generate(token_ids(1, 12), max_new_tokens=2, do_sample=False)
    finally:
        model.generation_config = saved
    assert "generation config" in _one_line(err.value) and name in str(err.value)
    assert forwards == []


# -- devices and dtypes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device,dtype,expect", [
    ("cuda", "float32", "CUDA"), ("cuda:7", "float32", "cuda:7"), ("tpu9", "float32", "not a torch device"),
    ("meta", "float32", "meta"), ("", "float32", "not a torch device"), ("cpu", "float99", "float99"),
    ("cpu", "int8", "int8"), ("cpu", torch.int8, "int8"), ("cpu", None, "None")])
def test_a_device_or_dtype_this_machine_cannot_run_is_one_line(device, dtype, expect):
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that device")
    with pytest.raises(PolykvError) as err:
        check_device(device, dtype)
    assert expect in _one_line(err.value)


def test_every_dtype_spelling_is_a_torch_dtype_name():
    assert [check_device("cpu", d) for d in ("fp32", "bf16", "half", torch.bfloat16)] == \
        ["float32", "bfloat16", "float16", "bfloat16"]
    with pytest.raises(PolykvError, match="float16 on --device cpu"):
        check_device("cpu", "fp16", half_on_cpu=False)


# -- model folders polykv cannot load ------------------------------------------------------------------------------
def test_pickled_weights_are_refused_naming_the_folder_and_the_fix(tmp_path):
    folder = tmp_path / "pickled"
    m = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    m.config.save_pretrained(str(folder))
    torch.save(m.state_dict(), str(folder / "pytorch_model.bin"))
    with pytest.raises(PolykvError) as err:
        load_by_name(str(folder))
    msg = _one_line(err.value)
    assert str(folder) in msg and "pytorch_model.bin" in msg and "safetensors" in msg


@pytest.mark.parametrize("make,expect", [
    (lambda d: d / "nope", "no such folder"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "not a folder"),
    (lambda d: (d / "m").mkdir() or d / "m", "config.json")])
def test_a_model_that_is_not_a_usable_folder_is_named(tmp_path, make, expect):
    with pytest.raises(PolykvError) as err:
        load_by_name(str(make(tmp_path)))
    assert expect in _one_line(err.value)


# -- caches polykv cannot write: the run goes on with what it computed -------------------------------------------
def _stats_plan(model):
    return polykv.uniform_plan(geometry_of_model(model), prefill=polykv.OpSpec(rule="triattention", capacity=8),
                               decode="full")


def _unwritable_cache(tmp_path, kind: str) -> str:
    if kind == "names-a-file":
        path = tmp_path / "cache-file"
        path.write_text("not a folder")
        return str(path)
    probe = "/sys/polykv-cache-probe"
    try:
        os.mkdir(probe)
    except OSError:
        return "/sys/polykv-cache"
    os.rmdir(probe)
    pytest.skip("this machine lets the test write under /sys; no read-only folder to point the cache at")


@pytest.mark.parametrize("kind", ["names-a-file", "read-only"])
def test_per_model_data_that_cannot_be_cached_is_used_and_said_in_one_line(saved_tiny_model, tmp_path, monkeypatch,
                                                                           kind):
    folder = saved_tiny_model(16)
    model, tokenizer = load_by_name(folder)
    monkeypatch.setattr(model_data_module, "cache_dir", REAL_CACHE_DIR)
    monkeypatch.setenv("POLYKV_CACHE", _unwritable_cache(tmp_path, kind))
    plan = _stats_plan(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with polykv.apply(model, plan, tokenizer=tokenizer):
            out = model.generate(torch.tensor([tokenizer.encode("The capital of France is")]), max_new_tokens=2,
                                 do_sample=False)
    assert out.shape[1] > 2
    cache = [w for w in caught if issubclass(w.category, CacheWriteWarning)]
    assert len(cache) == 1 and "not cached" in str(cache[0].message) and "POLYKV_CACHE" in str(cache[0].message)
    assert "\n" not in str(cache[0].message)


@pytest.mark.slow  # a child process with a file-size limit stands for a full disk
def test_a_full_disk_keeps_the_computed_data_and_refuses_the_output_file(saved_tiny_model, tmp_path):
    folder = saved_tiny_model(16)
    script = """
import resource, signal, sys, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
from polykv.cli import main
sys.exit(main(sys.argv[1:]))
"""
    env = dict(os.environ, POLYKV_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    out = tmp_path / "q.qstats.safetensors"
    run = subprocess.run([sys.executable, "-c", script, "model-data", folder, "triattention", "-o", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert run.returncode == 2 and lines[-1].startswith("polykv model-data: error: ") and "Traceback" not in run.stderr
    assert str(out) in lines[-1] and "nothing was written" in lines[-1]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # the runtime's cache of computed data on the same full disk: used, not cached, one warning line
    check = f"""
import resource, signal, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
import torch, polykv
from polykv.models.geometry import geometry_of_model
from polykv.models.local_folder import load_by_name
model, tok = load_by_name({folder!r})
plan = polykv.uniform_plan(geometry_of_model(model), prefill=polykv.OpSpec(rule="triattention", capacity=8),
                           decode="full")
with polykv.apply(model, plan, tokenizer=tok):
    print(model.generate(torch.tensor([tok.encode("The capital of France is")]), max_new_tokens=2,
                         do_sample=False).shape[1])
"""
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not cached" in run.stderr and "CacheWriteWarning" in run.stderr


@pytest.mark.model  # converts the default model's GGUF file again (~15 s)
def test_a_converted_model_that_cannot_be_cached_is_used_and_said_in_one_line(tmp_path):
    from polykv.models import load_default_model

    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = load_default_model(cache_dir=blocker / "models")
    cache = [w for w in caught if issubclass(w.category, CacheWriteWarning)]
    assert len(cache) == 1 and "not cached" in str(cache[0].message) and "\n" not in str(cache[0].message)
    assert model(torch.tensor([tokenizer.encode("Hello")])).logits.isfinite().all()


# -- a study's full baseline --------------------------------------------------------------------------------------
def test_the_full_baseline_is_built_from_the_model_alone(tmp_path):
    from polykv.studies.designs import build_policies, check_policies_fit, spec_geometry
    from polykv.studies.spec import load_spec

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    stats = tmp_path / "tiny.qstats.safetensors"
    compute_query_stats(model, [token_ids(1, 32)]).save(stats)
    plan = polykv.per_layer_plan(geo, [{"prefill": polykv.OpSpec(rule="triattention", capacity=16)},
                                       {"prefill": polykv.OpSpec(rule="kvzip-head", capacity_ratio=0.5)}])
    import attrs

    from polykv.plan import AllocationGroup

    plan = attrs.evolve(plan, model_data={"triattention": str(stats)}, trigger=attrs.evolve(plan.trigger,
                                                                                            decode_slack=7),
                        allocation=(AllocationGroup(allocator="kvzip-head", layers=(1,)),))
    plan.save(str(tmp_path / "mine.plan.json"))
    spec = {"name": "s", "model": {"tiny": {"family": "llama", "layers": 2, "heads": 4, "kv_heads": 2,
                                            "head_dim": 16, "vocab": 128, "seed": 0}},
            "context_tokens": 64, "plans": {"mine": "mine.plan.json"}, "baseline": True,
            "tasks": [{"task": "passkey", "params": {"length": 64, "digits": 3, "max_new_tokens": 3}, "samples": 1}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    loaded = load_spec(str(tmp_path / "spec.json"))
    policies = build_policies(loaded)
    full = next(p for p in policies if p.name == "full")
    assert policies[0] is full
    assert full.plan.model_data == {} and not full.plan.allocation and full.plan.keeps_everything
    assert full.plan.trigger == polykv.full_plan(spec_geometry(loaded)).trigger
    assert all(lp.k_bits == lp.v_bits == 16 for lp in full.plan.layers)
    assert full.plan.model.fingerprint == spec_geometry(loaded).fingerprint
    check_policies_fit(loaded, policies, registry=get_registry())


# -- RoPE frequencies held in bfloat16 or float16 ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistics_serve_a_model_cast_to_half_precision(dtype):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    stats = compute_query_stats(model, [token_ids(1, 32)])
    stats.check_model(model.to(dtype))                       # the cast rounds inv_freq: still the same frequencies
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    compute_query_stats(model.to(dtype), [token_ids(1, 32)]).check_model(
        tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16))     # and the other way round


def test_truly_different_frequencies_name_the_buffer_its_dtype_the_difference_and_the_fixes():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    stats = compute_query_stats(model, [token_ids(1, 32)])
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16).to(torch.bfloat16)
    other.model.rotary_emb.inv_freq.mul_(1.1)            # same config, other frequencies (e.g. a patched RoPE)
    with pytest.raises(ProfileError) as err:
        stats.check_model(other)
    msg = _one_line(err.value)
    assert "model.model.rotary_emb.inv_freq" in msg and "bfloat16" in msg and "relative" in msg
    assert "load it in that dtype" in msg and "compute_query_stats" in msg and "vs 8 frequencies" not in msg


# -- model-data: every key it lists ----------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(known_needs(get_registry())))
def test_model_data_computes_every_key_it_lists(saved_tiny_model, tmp_path, capsys, key):
    import shutil

    need = known_needs(get_registry())[key][0]
    folder = tmp_path / "model"     # KVzip's probe runs a whole corpus text again after it: room for 2 x 2,048
    shutil.copytree(saved_tiny_model(16), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=8192)))
    out = tmp_path / f"tiny{need.suffix}"
    assert main(["model-data", str(folder), key, "-o", str(out)]) == 0, capsys.readouterr().err
    assert need.load(str(out)) is not None
    model, _ = load_by_name(str(folder))
    if need.check is not None:
        need.check(need.load(str(out)), model)
