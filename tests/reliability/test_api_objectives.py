"""Bad calibration objectives through the Python API: ``calibrate``'s settings and a ``Profile`` built with bad
``objective_weights`` raise polykv's own errors naming the objective, weight or field, before any model forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cases_objectives import PROFILES, mixed_profile

from polykv.errors import ProfileError
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import CalibrationSettings
from polykv.profiling.profile import Profile
from polykv.profiling.profile import from_dict
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)


def _ids(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (96,), generator=g) for _ in range(n)]


def _settings(**changes) -> CalibrationSettings:
    return CalibrationSettings(**{**dict(rules=("streamingllm",), keeps=(0.5, 1.0), bits=(16,), prefix=64,
                                         stat_capacity=16), **changes})


@pytest.mark.parametrize("changes, match", [
    ({"objectives": ("gist",)}, "unknown"),
    ({"objectives": ()}, "none given"),
    ({"objectives": ("continuation", "retrieval"), "objective_weights": {"retrieval": -1}}, "weight of retrieval"),
    ({"objectives": ("continuation", "retrieval"), "objective_weights": {"retrieval": float("nan")}},
     "weight of retrieval"),
    ({"objectives": ("continuation", "retrieval"), "objective_weights": {"retrieval": "2"}}, "weight of retrieval"),
    ({"objectives": ("continuation",), "objective_weights": {"retrieval": 1}}, "not among the objectives"),
    ({"objectives": ("continuation", "retrieval"), "objective_weights": {"continuation": 0, "retrieval": 0}},
     "all 0"),
])
def test_bad_objective_settings_are_refused_before_any_forward(model, forwards, changes, match):
    with pytest.raises(ProfileError, match=match):
        calibrate(model, _ids(1, 0), _settings(**changes), heldout=_ids(1, 1))
    assert not forwards


@pytest.mark.parametrize("objective", ["reconstruction", "retrieval"])
def test_an_objective_that_needs_the_tokenizer_says_so_before_any_forward(model, forwards, objective):
    with pytest.raises(ProfileError, match=f"the {objective} objective needs the model's tokenizer"):
        calibrate(model, _ids(1, 0), _settings(objectives=("continuation", objective)), heldout=_ids(1, 1))
    assert not forwards


def test_objectives_without_heldout_sequences_are_refused(model, forwards):
    with pytest.raises(ProfileError, match="held-out"):
        calibrate(model, _ids(1, 0), _settings(objectives=("reconstruction",)))
    assert not forwards


def test_the_valid_mixed_profile_routes_on_its_mix():
    prof = from_dict(mixed_profile())
    assert prof.default_metric == "kl_mix" and prof.objective_weights == {"l2": 1.0, "kl": 2.0}


@pytest.mark.parametrize("case", PROFILES, ids=lambda c: c[0])
def test_a_bad_mix_is_refused_by_the_reader_naming_the_field(case):
    _id, raw, field = case
    with pytest.raises(ProfileError, match=f"field '{field}"):
        from_dict(raw, "prof.json")


@pytest.mark.parametrize("weights, field", [
    ({"l2": float("nan"), "kl": 1.0}, "objective_weights.l2"), ({"l2": float("inf")}, "objective_weights.l2"),
    ({"l2": -0.5}, "objective_weights.l2"), ({"kl_reconstruction": 1.0}, "objective_weights.kl_reconstruction")])
def test_a_profile_built_in_python_with_bad_weights_is_refused(weights, field):
    prof = from_dict(mixed_profile())
    l2 = prof.metrics["l2"]
    with pytest.raises(ProfileError, match=f"field '{field}'"):
        Profile(model=prof.model, configs=prof.configs, metrics={"l2": l2, "kl_mix": l2}, objective_weights=weights)
    assert np.isfinite(l2).all()
