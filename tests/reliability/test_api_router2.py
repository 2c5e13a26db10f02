"""Bad input to the per-KV-head table (``Profile.head_metrics``, ``merge_profiles``, ``calibrate(head_losses=)``)
and to refine's Ray pool (``MeterPool``) through the Python API: one clear line each, naming the field or
parameter, raised before anything runs."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from cases import profile_dict
from polykv.errors import ProfileError, SolverError
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import CalibrationSettings
from polykv.profiling.merge import merge_profiles
from polykv.profiling.meter_pool import MeterPool
from polykv.profiling.profile import from_dict
from polykv.testing import tiny_model


def _profile(**heads):
    d = profile_dict()
    if heads:
        d["head_metrics"] = heads
    return from_dict(json.loads(json.dumps(d)), source="p.profile.json")


def _one_line(info, needle: str) -> None:
    text = str(info.value)
    assert needle in text and "\n" not in text and "p.profile.json" in text, text


GOOD = [[[0.1] * 12, [0.2] * 12], [[0.1] * 12, [0.2] * 12]]


@pytest.mark.parametrize("heads, needle", [
    ({"kl": GOOD}, "head_metrics.kl"),
    ({"l2": [[0.1] * 12] * 2}, "head_metrics.l2"),
    ({"l2": [[[0.1] * 12], [[0.1] * 12]]}, "head_metrics.l2"),
    ({"l2": [[[0.1] * 11] * 2] * 2}, "head_metrics.l2"),
    ({"l2": [[[0.1] * 12, [0.1] * 11], [[0.1] * 12] * 2]}, "head_metrics.l2"),
    ({"l2": [[[True] * 12] * 2] * 2}, "head_metrics.l2"),
    ({"l2": [[[-1.0] * 12] * 2] * 2}, "head_metrics.l2"),
    ({"l2": "table"}, "head_metrics.l2"),
])
def test_a_bad_head_table_in_a_file_is_one_line_naming_the_field(heads, needle):
    with pytest.raises(ProfileError) as info:
        _profile(**heads)
    _one_line(info, needle)


def test_a_bad_head_table_built_in_python_is_refused():
    good = _profile(l2=GOOD)
    with pytest.raises(ProfileError) as info:
        attrs.evolve(good, head_metrics={"l2": np.full((2, 2, 12), np.inf)})
    assert "head_metrics.l2" in str(info.value) and "\n" not in str(info.value)


def test_extending_needs_the_same_head_tables_on_both_sides():
    with pytest.raises(ProfileError) as info:
        merge_profiles(_profile(l2=GOOD), _profile())
    assert "head_metrics" in str(info.value) and "\n" not in str(info.value)


def test_head_losses_with_ranks_is_refused_before_measuring():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2, head_dim=32)
    seqs = [np.arange(1, 81) % 120 + 1]
    with pytest.raises(ProfileError) as info:
        calibrate(model, seqs, CalibrationSettings(rules=("tova",), prefix=64, head_losses=True, ranks=(16,)))
    assert "--head-losses" in str(info.value) and "--ranks" in str(info.value)


@pytest.mark.parametrize("kw", [{"workers": 0}, {"workers": -1}, {"cpus_per_worker": 0}, {"cpus_per_worker": float("nan")}])
def test_a_ray_pool_without_room_for_a_worker_is_refused_before_ray_starts(kw):
    with pytest.raises(SolverError) as info:
        MeterPool(lambda: None, {}, **kw)
    assert "--workers" in str(info.value) and "\n" not in str(info.value)
