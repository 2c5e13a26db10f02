"""``refine`` on Ray: each step's candidates measured by workers, the plan and the record the serial run's."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from polykv.cli import main
from polykv.models.local_folder import load_by_name
from polykv.plan import load_plan
from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn, OnRay

pytestmark = pytest.mark.slow  # starts a local Ray

T, FOLLOW = 64, 16
PARAMS = {"tokens": T, "follow_up": FOLLOW, "sequences": 2, "steps": 3, "tries": 4}
BUDGET = Budget.parse("2x", T, basis="resident")


def _profile(model) -> Profile:
    from polykv.models.geometry import geometry_of_model

    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5, 0.75, 1.0), k_bits=(16, 8), v_bits=(16, 8))
    configs = [c if c.keep < 1.0 else CandidateConfig(rule="full", keep=1.0, k_bits=c.k_bits, v_bits=c.v_bits)
               for c in configs]
    configs += moend_configs("tova", "prefill", keeps=(0.25, 0.5, 0.75), k_bits=(16, 8), v_bits=(16, 8))
    wrong = np.array([c.keep + (c.k_bits + c.v_bits) / 64 for c in configs])  # less loss for less memory: refine moves
    return Profile.from_table(wrong + 0.01 * np.random.default_rng(0).random((2, len(configs))), configs,
                              geometry_of_model(model))


def _serial(folder, profile, **params):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same float sums, hence the same bits
    try:
        model, tokenizer = load_by_name(folder, dtype="float32")
        return solve(profile, BUDGET, "refine", model=MeasureOn(model=model, tokenizer=tokenizer, name="tiny"),
                     **PARAMS, **params)
    finally:
        torch.set_num_threads(threads)


def _same(a, b) -> None:
    ma, mb = a.provenance.measured, b.provenance.measured
    assert a.layers == b.layers
    for key in ("exact_kl", "refine_kl", "accepted", "measured", "stopped", "validation"):
        assert ma[key] == mb[key], key
    assert ma["steps"] == mb["steps"]


def test_refine_on_ray_is_the_serial_search(local_ray, saved_tiny_model):
    """Through the Python API, on objectives other than the profile's (the CLI test below covers the default ones)."""
    folder = saved_tiny_model(32)
    model, tokenizer = load_by_name(folder, dtype="float32")
    profile = _profile(model)
    extra = {"objectives": ["continuation", "reconstruction"]}
    serial = _serial(folder, profile, **extra)
    on = MeasureOn(model=model, tokenizer=tokenizer, name="tiny",
                   ray=OnRay(loader=functools.partial(load_by_name, folder, dtype="float32"), workers=2, threads=1))
    ray = solve(profile, BUDGET, "refine", model=on, **PARAMS, **extra)
    _same(serial, ray)
    m = ray.provenance.measured
    assert m["accepted"] >= 1  # the profile is wrong on purpose: the search moves
    assert m["ray_measured"] >= m["measured"] - 1  # every tried move went to the workers, some ahead of the order


def test_the_cli_refines_on_ray_to_the_serial_plan(local_ray, saved_tiny_model, tmp_path):
    """``solve --ray``: the profile's own objectives, with a validation sequence; the plan and its whole record
    (validation included) are the serial run's."""
    folder = saved_tiny_model(32)
    model, _ = load_by_name(folder, dtype="float32")
    path = tmp_path / "p.profile.json"
    _profile(model).save(str(path))
    params = {**PARAMS, "validate": 1}
    common = ["solve", str(path), "--budget", "2x", "--context", str(T), "--solver", "refine", "--model", folder,
              "--tokens", str(T), *[f"--param={k}={v}" for k, v in params.items() if k != "tokens"]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same float sums, hence the same bits
    try:
        assert main([*common, "-o", str(tmp_path / "serial.plan.json")]) == 0
        assert main([*common, "-o", str(tmp_path / "ray.plan.json"), "--ray", "--workers", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    serial, ray = (load_plan(str(tmp_path / f"{n}.plan.json")) for n in ("serial", "ray"))
    _same(serial, ray)
    m = ray.provenance.measured
    assert m["validation"]["sequences"] == 1 and m["accepted"] >= 1
    assert m["ray_measured"] >= m["measured"] - 1
