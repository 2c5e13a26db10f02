"""Bad-input cases of ``polykv solve`` with the measuring solver ``refine``: refused before a model loads."""

from __future__ import annotations

from cases import add, model_folder, profile_dict, write


def _solve(d, *extra):
    return ["solve", write(d, "prof.json", profile_dict()), "--budget", "2x", "--context", "256",
            "-o", "out.plan.json", *extra]


add("solve-refine-without-model", "cli", lambda d: _solve(d, "--solver", "refine"), "--model",
    outputs=("out.plan.json",))
add("solve-tokens-with-exact", "cli", lambda d: _solve(d, "--solver", "exact", "--tokens", "128"), "--tokens",
    outputs=("out.plan.json",))
add("solve-refine-tokens-disagree", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d), "--tokens", "128",
                     "--param", "tokens=64"), "--tokens", outputs=("out.plan.json",))
add("solve-refine-bad-steps", "cli",
    lambda d: _solve(d, "--solver", "refine", "--model", model_folder(d), "--param", "steps=-1"), "steps",
    outputs=("out.plan.json",))
