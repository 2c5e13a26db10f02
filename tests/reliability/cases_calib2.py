"""Bad end-to-end kl options: ``polykv calibrate --validate / --kl-configs / --validate-configs`` and
``polykv solve --metric``; each refused in one line naming the option, before a model loads or a plan is written."""

from __future__ import annotations

from cases import add, model_folder, profile_dict, write

CALIBRATE = [
    ("validate-text", ["--validate", "two"], "--validate"),
    ("validate-float", ["--validate", "1.5"], "--validate"),
    ("validate-no-value", ["--validate"], "--validate"),
    # one follow-up token leaves no position after the prefill's own prediction to measure kl (or l2) on
    ("validate-one-followup", ["--tokens", "65", "--prefix", "64"], "--tokens"),
    ("kl-configs-unknown", ["--kl-configs", "some"], "--kl-configs"),
    ("kl-configs-empty", ["--kl-configs", ""], "--kl-configs"),
    ("kl-configs-upper", ["--kl-configs", "ALL"], "--kl-configs"),
    ("validate-configs-neg", ["--validate-configs", "-3"], "--validate-configs"),
    ("validate-configs-text", ["--validate-configs", "eight"], "--validate-configs"),
]
for _id, _args, _expect in CALIBRATE:
    add(f"calib2-calibrate-{_id}", "cli", lambda d, a=_args: ["calibrate", model_folder(d), "-o", "x.profile.json", *a],
        _expect, ("x.profile.json", "x.qstats.safetensors"))


def _solve(d, *extra: str) -> list[str]:
    return ["solve", write(d, "prof.json", profile_dict()), "--budget", "4x", "--context", "256", "-o", "out.plan.json",
            *extra]


SOLVE = [
    ("metric-absent", ["--metric", "kl"], "--metric kl"),                   # an l2-only profile has no kl table
    ("metric-empty", ["--metric", ""], "--metric"),
    ("metric-no-value", ["--metric"], "--metric"),
    ("metric-disagrees", ["--metric", "l2", "--param", "metric=kl"], "--metric l2 and --param metric=kl"),
    ("metric-solver-without", ["--metric", "l2", "--solver", "pyramid"], "--metric"),
    ("metric-case", ["--metric", "L2"], "--metric L2"),
]
for _id, _args, _expect in SOLVE:
    add(f"calib2-solve-{_id}", "cli", lambda d, a=_args: _solve(d, *a), _expect, ("out.plan.json",))
