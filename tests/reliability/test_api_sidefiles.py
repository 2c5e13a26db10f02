"""Side files a plan names, through the Python API: a missing file is never silently replaced, and every loaded
file's content is checked (dtype, finite, non-negative, orthonormal bases) in one line naming the file."""

from __future__ import annotations

import os
import warnings

import attrs
import pytest
import torch

import polykv
from polykv.contract.model_data import ModelDataError, ModelDataNote, cached_file
from polykv.errors import ProfileError
from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KVBases
from polykv.adapters.rules.kvzip_heads import HeadScores
from polykv.adapters.rules.query_stats import QueryStats
from polykv.plan import AllocationGroup, OpSpec
from polykv.registry import get_registry
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=64)


def _head_plan(model, tmp_path, name="gone.kvzip-heads.safetensors"):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip-head", capacity_ratio=0.5), decode="full")
    return attrs.evolve(plan, allocation=(AllocationGroup(allocator="kvzip-head", layers=(0, 1)),),
                        model_data={"kvzip-head": str(tmp_path / name)})


def _cache_scores(model, tmp_path, monkeypatch):
    """Head scores for this model in the model-data cache (what a missing plan file must not silently become)."""
    monkeypatch.setenv("POLYKV_CACHE", str(tmp_path / "cache"))
    fp = geometry_of_model(model).fingerprint
    path = cached_file(get_registry().rule("kvzip-head").model_data_need, fp)
    os.makedirs(os.path.dirname(path))
    HeadScores(scores=torch.rand(2, 2), fingerprint=fp, num_tokens=8).save(path)
    return path


@pytest.mark.parametrize("how", ["missing", "dangling-symlink"])
def test_refuse_refuses_a_missing_plan_file_even_when_the_cache_has_data(model, tmp_path, monkeypatch, how):
    _cache_scores(model, tmp_path, monkeypatch)
    plan = _head_plan(model, tmp_path)
    if how == "dangling-symlink":
        os.symlink(str(tmp_path / "elsewhere"), plan.model_data["kvzip-head"])
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, plan, missing_model_data="refuse")
    msg = str(err.value)
    assert "\n" not in msg and "model_data.kvzip-head" in msg and plan.model_data["kvzip-head"] in msg


def test_the_default_mode_says_which_data_replaces_a_missing_plan_file(model, tmp_path, monkeypatch):
    cached = _cache_scores(model, tmp_path, monkeypatch)
    plan = _head_plan(model, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with polykv.apply(model, plan):
            pass
    notes = [str(w.message) for w in caught if issubclass(w.category, ModelDataNote)]
    assert any(plan.model_data["kvzip-head"] in n and "does not exist" in n and cached in n for n in notes), notes


def _bases(scale=1.0, **over):
    eye = torch.eye(16).expand(2, 2, 16, 16).clone()
    energy = torch.linspace(1, 0, 16).expand(2, 2, 16).clone()
    arrays = dict(key=eye * scale, value=eye.clone(), key_energy=energy, value_energy=energy.clone())
    arrays.update(over)
    return KVBases(**arrays, fingerprint="cfg-0+s-0", num_tokens=8)


@pytest.mark.parametrize("bases,expect", [
    (_bases(scale=10.0), "key basis of layer 0, KV head 0 is not orthonormal"),
    (_bases(scale=0.0), "key basis of layer 0, KV head 0 is not orthonormal"),
    (_bases(value=torch.full((2, 2, 16, 16), float("nan"))), "tensor 'value' holds"),
])
def test_damaged_bases_are_refused_when_loaded(tmp_path, bases, expect):
    path = str(tmp_path / "b.kvbases.safetensors")
    bases.save(path)
    with pytest.raises(ProfileError) as err:
        KVBases.load(path)
    assert "\n" not in str(err.value) and expect in str(err.value) and path in str(err.value)


def _stats(**over):
    arrays = dict(mu_real=torch.rand(2, 4, 8), mu_imag=torch.rand(2, 4, 8), mean_abs=torch.rand(2, 4, 8),
                  inv_freq=torch.rand(8))
    arrays.update(over)
    return QueryStats(**arrays, attention_scaling=1.0, fingerprint="cfg-0+s-0", num_tokens=8, pairing="half")


@pytest.mark.parametrize("stats,expect", [
    (_stats(mean_abs=-torch.rand(2, 4, 8)), "tensor 'mean_abs' holds negative values"),
    (_stats(mu_real=torch.full((2, 4, 8), float("inf"))), "tensor 'mu_real' holds 64 NaN or infinite"),
    (_stats(mu_imag=torch.full((2, 4, 8), float("nan"))), "tensor 'mu_imag' holds 64 NaN or infinite"),
])
def test_damaged_query_statistics_are_refused_when_loaded(tmp_path, stats, expect):
    path = str(tmp_path / "q.qstats.safetensors")
    stats.save(path)
    with pytest.raises(ProfileError) as err:
        QueryStats.load(path)
    assert "\n" not in str(err.value) and expect in str(err.value)


def test_a_valid_side_file_outside_the_plans_folder_or_without_fingerprint_gets_one_note(model, tmp_path):
    from polykv.plan.side_files import check_side_files

    (tmp_path / "plans").mkdir()
    HeadScores(scores=torch.rand(2, 2), fingerprint=None, num_tokens=8).save(str(tmp_path / "s.kvzip-heads.safetensors"))
    plan = _head_plan(model, tmp_path, name="s.kvzip-heads.safetensors")
    source = str(tmp_path / "plans" / "p.json")
    plan.save(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_side_files(plan, get_registry(), source)
    notes = [str(w.message) for w in caught if issubclass(w.category, ModelDataNote)]
    assert len(notes) == 2 and all("\n" not in n and "model_data.kvzip-head" in n for n in notes)
    assert "outside the plan's folder" in notes[0] and "no model fingerprint" in notes[1]
