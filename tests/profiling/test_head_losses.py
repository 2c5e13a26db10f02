"""Per-KV-head losses: measured by calibration (``head_losses``), kept by the profile file, checked on load."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from polykv.errors import ProfileError
from polykv.profiling.calibrate import calibrate
from polykv.profiling.capture import capture_sequence, stack_layer
from polykv.profiling.profile import loads
from polykv.profiling.sensitivity import full_reference
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def measured(sequences, small_settings):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)
    seqs = sequences(1)
    settings = small_settings(rules=("tova", "snapkv"), keeps=(0.25, 0.5, 1.0), bits=(16, 4), head_losses=True)
    return model, seqs, settings, calibrate(model, seqs, settings).profile


def test_each_head_is_its_query_groups_share_of_the_layer_error(measured, prefix):
    model, seqs, _, profile = measured
    heads = profile.head_metrics["l2"]
    assert heads.shape == (2, 2, len(profile.configs)) and (heads >= 0).all()
    for layer in range(2):  # ||o - ref||^2 is the sum over KV heads' query groups of theirs (one sequence)
        ref = full_reference(stack_layer([capture_sequence(model, seqs[0])], layer), prefix)
        group = [float(torch.linalg.vector_norm(ref[:, h * 2:(h + 1) * 2]).double()) ** 2 for h in range(2)]
        total = float(torch.linalg.vector_norm(ref).double()) ** 2
        combined = np.sqrt((heads[layer] ** 2 * np.array(group)[:, None]).sum(0) / total)
        np.testing.assert_allclose(combined, profile.metrics["l2"][layer], rtol=1e-5, atol=1e-7)
    evicting = [i for i, c in enumerate(profile.configs) if c.keep < 1.0 and c.k_bits == c.v_bits == 16]
    assert (heads[:, :, evicting] > 0).all()
    assert not np.allclose(heads[:, 0, evicting], heads[:, 1, evicting])  # the heads differ


def test_the_table_survives_the_file_and_changes_the_fingerprint(measured):
    profile = measured[3]
    back = loads(profile.to_json())
    np.testing.assert_array_equal(back.head_metrics["l2"], profile.head_metrics["l2"])
    assert back.fingerprint == profile.fingerprint
    assert attrs.evolve(profile, head_metrics=None).fingerprint != profile.fingerprint
    assert "head_metrics l2" in profile.provenance.note


@pytest.mark.parametrize("change, field", [
    (lambda h: {"kl": h["l2"]}, "head_metrics.kl"),                     # a table the profile does not have
    (lambda h: {"l2": h["l2"][:, :1]}, "head_metrics.l2"),              # one KV head short
    (lambda h: {"l2": -h["l2"]}, "head_metrics.l2"),                     # not a loss
    (lambda h: {"l2": np.where(h["l2"] > 0.1, np.nan, h["l2"])}, "head_metrics.l2"),
])
def test_a_bad_head_table_is_refused_naming_the_field(measured, change, field):
    profile = measured[3]
    with pytest.raises(ProfileError, match=field.replace(".", r"\.")):
        attrs.evolve(profile, head_metrics=change(profile.head_metrics))


def test_head_losses_with_ranks_is_refused(measured):
    model, seqs, settings, _ = measured
    with pytest.raises(ProfileError, match="--head-losses"):
        calibrate(model, seqs, attrs.evolve(settings, ranks=(16, None)))
