"""Calibration of the rank and layer-pair axes: measured through the runtime's own path, composed additively."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from polykv.errors import ProfileError
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_axes import rank_pairs
from polykv.profiling.capture import capture_sequence, stack_layer
from polykv.profiling.profile import loads
from polykv.profiling.rank_error import layer_rank_errors
from polykv.profiling.share_error import pair_errors


@pytest.fixture(scope="module")
def four_axes(model, sequences, small_settings):
    settings = small_settings(rules=("tova",), keeps=(0.5, 1.0), bits=(16, 4), ranks=(None, 16), pairs=True)
    return calibrate(model, sequences(), settings), settings


def test_rank_configs_compose_additively_with_the_measured_rank_error(four_axes):
    result, _ = four_axes
    prof = result.profile
    assert prof.axes == ("tokens", "bits", "rank", "layers")
    labels = {c.label: i for i, c in enumerate(prof.configs)}
    stat = prof.stats["rank_l2"]
    assert stat.columns == ("KdV16", "K16Vd", "K16V16")
    low = [c for c in prof.configs if c.low_rank]
    assert low and all(c.v_bits == 16 or c.v_rank is None for c in low)   # KIVI: 4-bit values in groups of 32
    l2 = prof.table("l2")
    for c in low:
        j = stat.columns.index("K{}V{}".format(*("d" if r is None else r for r in (c.k_rank, c.v_rank))))
        np.testing.assert_array_equal(l2[:, labels[c.label]], l2[:, labels[c.base.label]] + stat.values[:, j])
    assert "additive" in prof.provenance.note


def test_rank_errors_are_the_runtime_measurement(four_axes, model, sequences, prefix):
    result, settings = four_axes
    caps = [capture_sequence(model, s) for s in sequences()]
    for layer in range(3):
        want = layer_rank_errors(stack_layer(caps, layer), prefix, rank_pairs(settings.ranks),
                                 result.model_data[KV_BASES_KEY])
        np.testing.assert_allclose(result.profile.stats["rank_l2"].values[layer], want, rtol=1e-6)


def test_pair_table_is_the_runtime_merge_error(four_axes, model, sequences, prefix):
    result, _ = four_axes
    caps = [capture_sequence(model, s) for s in sequences()]
    want = pair_errors([stack_layer(caps, layer) for layer in range(3)], prefix)
    pairs = result.profile.pairs
    assert pairs.uppers == (1, 2)
    np.testing.assert_allclose(pairs.values, [[e.lower_error, e.upper_error] for e in want], rtol=1e-6)


def test_four_axis_profile_round_trips_and_bases_are_a_side_file(four_axes, tmp_path):
    result, _ = four_axes
    prof = result.profile
    again = loads(prof.to_json())
    assert again.fingerprint == prof.fingerprint and again.to_json() == prof.to_json()
    assert [c.label for c in again.configs] == [c.label for c in prof.configs]
    files = result.side_files(str(tmp_path / "x.profile.json"))
    assert str(tmp_path / "x.kvbases.safetensors") in files


def test_without_the_new_axes_calibration_is_unchanged(model, sequences, small_settings, four_axes):
    result, _ = four_axes
    plain = calibrate(model, sequences(), small_settings(rules=("tova",), keeps=(0.5, 1.0), bits=(16, 4))).profile
    assert plain.axes == ("tokens", "bits") and plain.pairs is None and "rank_l2" not in plain.stats
    full = [i for i, c in enumerate(result.profile.configs) if not c.low_rank]
    np.testing.assert_array_equal(result.profile.table("l2")[:, full], plain.table("l2"))
    assert result.profile.without_axes().fingerprint == result.profile.fingerprint


@pytest.mark.parametrize("changes, match", [({"ranks": (64,)}, "outside 1..32"), ({"ranks": (0,)}, "outside 1..32")])
def test_refusals(model, sequences, small_settings, changes, match):
    with pytest.raises(ProfileError, match=match):
        calibrate(model, sequences(), small_settings(rules=("tova",), keeps=(1.0,), bits=(16,), **changes))
