"""Documents larger than any polykv file can be are refused by size, before a byte is parsed.

The files are sparse (``truncate``), so the cases cost no disk and no time.
"""

from __future__ import annotations

import os
from pathlib import Path

from cases import add, model_folder

TOO_BIG = (64 << 20) + 1


def huge(d: Path, name: str) -> str:
    path = d / name
    with open(path, "wb") as fh:
        fh.truncate(TOO_BIG)
    return str(path)


add("plan-too-large", "plan", lambda d: ["plan", "validate", huge(d, "big.plan.json")], "larger than any plan file")
add("profile-too-large", "profile", lambda d: ["solve", huge(d, "big.profile.json"), "--budget", "4x", "--context",
                                               "256", "-o", "out.plan.json"], "larger than any profile file",
    ("out.plan.json",))
add("spec-too-large", "spec", lambda d: ["study", huge(d, "spec.json"), "--check", "--results", str(d / "r.jsonl")],
    "larger than any study spec", ("r.jsonl",))


def _big_config(d: Path) -> list[str]:
    folder = model_folder(d)
    os.remove(os.path.join(folder, "config.json"))
    huge(Path(folder), "config.json")
    return ["plan", "show", "--model", folder, "--context", "64", _plan(d)]


def _plan(d: Path) -> str:
    from cases import plan_dict, write

    return write(d, "plan.json", plan_dict())


add("model-config-too-large", "cli", _big_config, "larger than any model config")
