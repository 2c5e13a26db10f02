"""Bad inputs to the refine solver and the plan meter through the Python API: one clear exception each."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from polykv.errors import ProfileError, RuntimeConfigError, SolverError
from polykv.models.geometry import geometry_of_model
from polykv.profiling.budget import Budget
from polykv.profiling.endtoend import PlanMeter, heldout_sequences
from polykv.profiling.profile import Profile, ProfileProvenance, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn
from polykv.testing import tiny_model, token_ids

BUDGET = Budget.parse("2x", 64, basis="resident")


def _profile(geometry_or_dims):
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5), k_bits=(16,), v_bits=(16,))
    return Profile.from_table(np.random.default_rng(0).random((2, len(configs))), configs, geometry_or_dims)


class _Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % 120 + 1 for b in text.encode()]}


def test_refine_without_a_model_names_the_option():
    with pytest.raises(SolverError, match=r"solver 'refine' measures its candidate plans on the model and needs one: "
                                          r"pass --model default"):
        solve(_profile((2, 2, 32)), BUDGET, "refine")


def test_refine_on_another_model_names_the_profile_field():
    model = tiny_model(layers=3, head_dim=32)
    with pytest.raises(ProfileError, match=r"model\.num_layers.*num_layers=2 but the model has 3"):
        solve(_profile((2, 2, 32)), BUDGET, "refine", model=MeasureOn(model=model, tokenizer=_Tok()), tokens=32)


def test_refine_bad_parameter_names_it():
    model = tiny_model(layers=2, head_dim=32)
    with pytest.raises(SolverError, match=r"solver 'refine'.*tries"):
        solve(_profile(geometry_of_model(model)), BUDGET, "refine", model=MeasureOn(model=model, tokenizer=_Tok()),
              tries=0)


def test_refine_without_a_context_length_asks_for_tokens():
    model = tiny_model(layers=2, head_dim=32)
    with pytest.raises(SolverError, match=r"records no calibration context length.*--tokens N"):
        solve(_profile(geometry_of_model(model)), BUDGET, "refine", model=MeasureOn(model=model, tokenizer=_Tok()))


def test_meter_refuses_sequences_shorter_than_the_prefix():
    model = tiny_model(layers=2, head_dim=32)
    with pytest.raises(RuntimeConfigError, match=r"held-out sequences \[1\] are shorter than the prefix \(40\) \+ 2"):
        PlanMeter(model, [token_ids(1, 60)[0], token_ids(1, 41)[0]], 40)


def test_heldout_draw_from_another_corpus_version_is_refused():
    prof = attrs.evolve(_profile((2, 2, 32)), provenance=ProfileProvenance(
        corpus="stdlib-r1/py0.0.0 mixed seed=0: 8 texts of >= 2560 chars cut to 640 tokens, texts sha256 x"))
    with pytest.raises(ProfileError, match=r"calibrated on corpus stdlib-r1/py0\.0\.0.*recalibrate"):
        heldout_sequences(lambda t: list(t.encode()), 2, 64, seed=0, profile=prof)

