"""Bad calibration objectives: ``polykv calibrate --objectives / --objective-weights`` refused in one line naming the
option before a model loads, and profiles whose ``objective_weights`` or ``kl_mix`` table are wrong refused by the
reader (``polykv solve``) naming the field."""

from __future__ import annotations

import json

import numpy as np

from cases import add, model_folder, mutate, profile_dict, write

BOTH = ["--objectives", "continuation,retrieval"]
CALIBRATE = [
    ("unknown", ["--objectives", "gist"], "--objectives"),
    ("empty", ["--objectives", ""], "--objectives"),
    ("commas-only", ["--objectives", ",,"], "--objectives"),
    ("twice", ["--objectives", "retrieval,retrieval"], "--objectives"),
    ("case", ["--objectives", "Retrieval"], "--objectives"),
    ("no-value", ["--objectives"], "--objectives"),
    # the objectives are measured on held-out sequences: none with --validate 0
    ("without-heldout", ["--objectives", "retrieval", "--validate", "0"], "--validate"),
    ("weight-negative", [*BOTH, "--objective-weights", "retrieval=-1"], "--objective-weights"),
    ("weight-nan", [*BOTH, "--objective-weights", "retrieval=nan"], "--objective-weights"),
    ("weight-inf", [*BOTH, "--objective-weights", "retrieval=inf"], "--objective-weights"),
    ("weight-text", [*BOTH, "--objective-weights", "retrieval=high"], "--objective-weights"),
    ("weight-no-equals", [*BOTH, "--objective-weights", "retrieval"], "--objective-weights"),
    ("weight-twice", [*BOTH, "--objective-weights", "retrieval=1,retrieval=2"], "--objective-weights"),
    ("weight-empty", [*BOTH, "--objective-weights", ""], "--objective-weights"),
    ("weight-not-an-objective", [*BOTH, "--objective-weights", "reconstruction=1"], "--objective-weights"),
    ("weight-unknown-name", [*BOTH, "--objective-weights", "gist=1"], "--objective-weights"),
    ("weights-all-zero", [*BOTH, "--objective-weights", "continuation=0,retrieval=0"], "--objective-weights"),
]
for _id, _args, _expect in CALIBRATE:
    add(f"objectives-calibrate-{_id}", "cli",
        lambda d, a=_args: ["calibrate", model_folder(d), "-o", "x.profile.json", *a], _expect,
        ("x.profile.json", "x.qstats.safetensors"))


def mixed_profile() -> dict:
    """The reliability profile with a second table (``kl``: l2 halved), their mix ``kl_mix`` = 1 x l2 + 2 x kl, and
    routing on it: a valid profile, each case below breaks one thing."""
    d = profile_dict()
    l2 = np.asarray(d["metrics"]["l2"])
    d["metrics"]["kl"] = (l2 / 2).tolist()
    d["metrics"]["kl_mix"] = (l2 + 2 * (l2 / 2)).tolist()
    d["objective_weights"] = {"l2": 1.0, "kl": 2.0}
    d["routing_metric"] = "kl_mix"
    return d


def _with(path: str, value=None, *, delete: bool = False) -> dict:
    return mutate(mixed_profile(), path, value, delete=delete)


def _unrouted(d: dict) -> dict:
    del d["routing_metric"]
    return d


def _scaled_mix() -> dict:
    d = mixed_profile()
    d["metrics"]["kl_mix"] = (np.asarray(d["metrics"]["kl_mix"]) * 1.5).tolist()
    return d


PROFILES = [
    ("weight-negative", _with("objective_weights.kl", -1.0), "objective_weights.kl"),
    ("weight-string", _with("objective_weights.kl", "2"), "objective_weights.kl"),
    ("weight-bool", _with("objective_weights.kl", True), "objective_weights.kl"),
    ("weight-null", _with("objective_weights.kl", None), "objective_weights.kl"),
    ("weight-unknown-table", _with("objective_weights.kl_retrieval", 1.0), "objective_weights.kl_retrieval"),
    ("weight-names-the-mix", _with("objective_weights.kl_mix", 1.0), "objective_weights.kl_mix"),
    ("weights-all-zero", _with("objective_weights", {"l2": 0.0, "kl": 0.0}), "objective_weights"),
    ("weights-empty", _with("objective_weights", {}), "objective_weights"),
    ("weights-list", _with("objective_weights", ["l2", "kl"]), "objective_weights"),
    ("mix-missing", _with("metrics.kl_mix", delete=True), "routing_metric"),          # routing names the absent mix
    ("mix-missing-unrouted", _unrouted(_with("metrics.kl_mix", delete=True)), "metrics.kl_mix"),
    ("mix-without-weights", _with("objective_weights", delete=True), "metrics.kl_mix"),
    ("mix-not-the-sum", _scaled_mix(), "metrics.kl_mix"),
]
for _id, _prof, _expect in PROFILES:
    add(f"objectives-profile-{_id}", "profile",
        lambda d, p=_prof: ["solve", write(d, "prof.json", p), "--budget", "4x", "--context", "256", "-o",
                            "out.plan.json"], _expect, ("out.plan.json",))

# NaN cannot be written as JSON by polykv; a hand-written NaN weight is refused as NaN anywhere is
add("objectives-profile-weight-nan", "profile", lambda d: [
    "solve", write(d, "prof.json", json.dumps(mixed_profile()).replace(
        '"kl": 2.0}', '"kl": NaN}')), "--budget", "4x", "--context", "256", "-o", "out.plan.json"],
    "prof.json", ("out.plan.json",))
