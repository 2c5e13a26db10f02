"""Bad input to the profiles and solving of the rank and layer-pair axes through the CLI: the calibrate options
``--ranks`` / ``--pairs``, and profile files whose rank configs or pair table are wrong, refused before any model
runs in one line naming the option or the field."""

from __future__ import annotations

from cases import add, model_folder, mutate, profile_dict, write


def _with_pairs(**changes) -> dict:
    d = profile_dict()  # 2 layers: one pair, upper layer 1
    d["pairs"] = {"uppers": [1], "values": [[0.3, 0.4]], **changes}
    return d


def _solve(d, profile) -> list[str]:
    return ["solve", write(d, "prof.json", profile), "--budget", "2x", "--context", "256", "-o", "out.plan.json"]


CALIBRATE_AXES = [
    ("ranks-above-one", ["--ranks", "3d/2", "--validate", "0"], "--ranks"),
    ("ranks-above-head-dim", ["--ranks", "d,99", "--validate", "0"], "--ranks"),
    ("ranks-zero", ["--ranks", "0", "--validate", "0"], "--ranks"),
    ("ranks-text", ["--ranks", "half", "--validate", "0"], "--ranks"),
]
for _id, _args, _expect in CALIBRATE_AXES:
    add(f"axes-calibrate-{_id}", "cli", lambda d, a=_args: ["calibrate", model_folder(d), "-o", "x.profile.json", *a],
        _expect, ("x.profile.json", "x.kvbases.safetensors"))

PROFILE_AXES = [
    ("pair-upper-0", _with_pairs(uppers=[0]), "pairs.uppers"),
    ("pair-upper-beyond", _with_pairs(uppers=[2]), "pairs.uppers"),
    ("pair-upper-text", _with_pairs(uppers=["1"]), "pairs.uppers[0]"),
    ("pair-values-shape", _with_pairs(values=[[0.3]]), "pairs.values"),
    ("pair-values-negative", _with_pairs(values=[[0.3, -1.0]]), "pairs.values"),
    ("pair-values-text", _with_pairs(values=[[0.3, "x"]]), "pairs.values[0][1]"),
    ("pair-no-values", mutate(_with_pairs(), "pairs.values", None, delete=True), "pairs"),
    ("pair-unknown-key", _with_pairs(colour=1), "pairs.colour"),
    ("pair-share-param", _with_pairs(share_params={"interpolation": 2.0}), "pairs.share_params"),
    ("config-rank-above-head-dim", mutate(profile_dict(), "configs.0.k_rank", 33), "configs[0].k_rank"),
    ("config-rank-zero", mutate(profile_dict(), "configs.1.v_rank", 0), "configs[1].v_rank"),
    ("config-rank-text", mutate(profile_dict(), "configs.1.v_rank", "16"), "configs[1].v_rank"),
]
for _id, _profile, _expect in PROFILE_AXES:
    add(f"axes-profile-{_id}", "profile", lambda d, p=_profile: _solve(d, p), _expect, ("out.plan.json",))
