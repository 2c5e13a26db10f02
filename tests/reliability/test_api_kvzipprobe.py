"""Per-model data measured through a probe (KVzip's head scores) through the Python API: the runtime's probe runner
is handed to the compute, so the result never depends on what the process imported before, and a compute
without it is refused in one line naming ``run_probe``, before the model runs and with nothing cached."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polykv.contract.model_data import ModelDataError, ModelDataNeed, cached_file, compute_over_corpus, find_model_data

FRESH = """
import torch
from polykv.adapters.rules.kvzip_head import compute_head_scores
from polykv.testing import tiny_model, token_ids


class Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 97 for ch in text]


model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
extra = {}
if {runner}:
    from polykv.runtime.session import run_probe
    extra["run_probe"] = run_probe
print(compute_head_scores(model, [token_ids(1, 30, seed=1)], tokenizer=Tok(), chunk_size=16, **extra).scores.shape)
"""


def _fresh(runner: bool) -> subprocess.CompletedProcess:
    """A new interpreter that imports only the head scores' module (not the runtime) and computes them."""
    return subprocess.run([sys.executable, "-c", FRESH.replace("{runner}", str(runner))], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # a fresh interpreter
def test_head_scores_without_the_runtime_imported_are_refused_naming_run_probe():
    run = _fresh(runner=False)
    assert run.returncode != 0 and "ModelDataError" in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "run_probe=polykv.runtime.session.run_probe" in last and "probe" in last


@pytest.mark.slow  # a fresh interpreter
def test_head_scores_with_the_runner_handed_in_need_no_earlier_import():
    run = _fresh(runner=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "torch.Size([2, 2])"


class Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 97 for ch in text]


def _probe_need(seen: list) -> ModelDataNeed:
    def compute(model, batches, *, run_probe):
        seen.append(run_probe)
        return object()

    return ModelDataNeed(key="probe-data", suffix=".probe-data.bin", compute=compute, load=lambda path: None,
                         description="probe data", takes_probe=True)


def test_a_need_measured_through_a_probe_is_refused_without_a_runner_and_nothing_is_cached(tmp_path, monkeypatch):
    from polykv.testing import tiny_model

    monkeypatch.setenv("POLYKV_CACHE", str(tmp_path))
    model, seen = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16), []
    need = _probe_need(seen)
    with pytest.raises(ModelDataError) as err:
        compute_over_corpus(need, model, Tok())
    msg = str(err.value)
    assert "\n" not in msg and "'probe-data'" in msg and "run_probe=polykv.runtime.session.run_probe" in msg
    with pytest.raises(ModelDataError, match="run_probe"):
        find_model_data(model, [need], tokenizer=Tok(), fingerprint="m")
    assert seen == [] and not os.path.exists(cached_file(need, "m")) and os.listdir(tmp_path) == []


def test_the_runner_handed_in_reaches_the_compute(tmp_path, monkeypatch):
    from polykv.runtime.session import run_probe
    from polykv.testing import tiny_model

    monkeypatch.setenv("POLYKV_CACHE", str(tmp_path))
    model, seen = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16), []
    with pytest.warns(Warning):   # computed over the offline corpus (one note); its object() cannot be cached
        find_model_data(model, [_probe_need(seen)], tokenizer=Tok(), fingerprint="m", run_probe=run_probe)
    assert seen == [run_probe]
    states = run_probe(model, "kvzip", {"repeat_ids": [5], "continue_ids": [6], "suffix_ids": [], "chunk_size": 8},
                       torch.arange(1, 20).view(1, -1))
    assert len(states) == 2 and states[0].scores.shape == (1, 2, 19)
