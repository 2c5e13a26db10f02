"""Calibration on Ray: the layers computed by workers, the profile equal to a serial run's."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from polykv.profiling.calibrate import calibrate
from polykv.profiling.distributed import calibrate_ray
from polykv.testing import tiny_model

pytestmark = pytest.mark.slow  # starts a local Ray


def _load(layers: int):
    return tiny_model("llama", layers=layers, heads=4, kv_heads=2, head_dim=32), None


def test_a_ray_calibration_is_the_serial_one(local_ray, sequences, small_settings):
    settings = small_settings(rules=("tova", "streamingllm"), keeps=(0.25, 1.0), bits=(16, 4))
    seqs, held = sequences(2), sequences(1, seed=7)
    loader = functools.partial(_load, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same float sums, hence the same bits
    try:
        serial = calibrate(loader()[0], seqs, settings, heldout=held, corpus="tiny").profile
    finally:
        torch.set_num_threads(threads)
    sent = []
    result = calibrate_ray(loader, seqs, settings, heldout=held, corpus="tiny", workers=2, threads=1,
                           on_dispatch=lambda pid, layer: sent.append((pid, layer)))
    assert sorted(layer for _, layer in sent) == [0, 1, 2] and len({pid for pid, _ in sent}) == 2
    prof = result.profile
    assert sorted(prof.metrics) == sorted(serial.metrics) == ["kl", "l2"]
    for name in prof.metrics:
        np.testing.assert_array_equal(prof.metrics[name], serial.metrics[name])
    for name in prof.stats:
        np.testing.assert_array_equal(prof.stats[name].values, serial.stats[name].values)
    assert prof.provenance.note == serial.provenance.note and result.seconds > 0


def test_the_cli_calibrates_on_ray_to_the_serial_profile(local_ray, saved_tiny_model, tmp_path, capsys):
    from polykv.cli import main
    from polykv.profiling.profile import load_profile

    folder = saved_tiny_model(32)
    common = [folder, "--sequences", "2", "--tokens", "96", "--prefix", "64", "--rules", "tova", "--keeps",
              "0.5,1.0", "--bits", "16,4", "--validate", "1", "--stat-capacity", "16", "--no-progress", "--threads", "1"]
    assert main(["calibrate", *common, "-o", str(tmp_path / "serial.profile.json")]) == 0
    assert main(["calibrate", *common, "-o", str(tmp_path / "ray.profile.json"), "--ray", "--workers", "2"]) == 0
    serial, ray = (load_profile(str(tmp_path / f"{n}.profile.json")) for n in ("serial", "ray"))
    assert serial.fingerprint == ray.fingerprint
    for name in serial.metrics:
        np.testing.assert_array_equal(serial.metrics[name], ray.metrics[name])
