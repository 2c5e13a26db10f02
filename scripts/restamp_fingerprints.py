"""Re-stamp the shipped profile, query statistics and plans with the default model's current fingerprint.

Nothing is re-measured: only ``model.fingerprint`` (and the plans' ``provenance.profile_fingerprint``,
which digests the profile's model record) change, in place, textually, so every other byte stays.

    .venv/bin/python scripts/restamp_fingerprints.py            # rewrite profiles/ and plans/
    .venv/bin/python scripts/restamp_fingerprints.py --check    # exit 1 when a file is stale
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _replace_all(text: str, old: str, new: str, path: str) -> str:
    if old == new:
        return text
    if old not in text:
        raise SystemExit(f"{path}: does not contain {old!r}")
    return text.replace(f'"{old}"', f'"{new}"')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale files")
    args = ap.parse_args(argv)
    import torch

    from polykv.atomic import replace_with, write_text_atomic
    from polykv.models.geometry import geometry_of_model
    from polykv.models import load_default_model
    from polykv.profiling.profile import load_profile

    torch.set_num_threads(1)
    model, _ = load_default_model()
    new_fp = geometry_of_model(model).fingerprint
    stale = []
    for prof_path in sorted(glob.glob(os.path.join(ROOT, "profiles", "*.profile.json"))):
        old_prof = load_profile(prof_path)
        old_fp = old_prof.model.fingerprint
        text = open(prof_path, encoding="utf-8").read()
        new_text = _replace_all(text, old_fp, new_fp, prof_path)
        if old_prof.provenance.dtype is None:  # calibrated before the dtype was recorded: float32 then
            lines = new_text.split("\n")
            at = next(i for i, line in enumerate(lines) if line.startswith('  "provenance": {'))
            lines[at] = lines[at][:-2] + ', "dtype": "float32"},'
            new_text = "\n".join(lines)
        if new_text != text:
            stale.append(prof_path)
            if not args.check:
                write_text_atomic(prof_path, new_text)
        from polykv.profiling.profile import loads

        new_prof_fp = loads(new_text, prof_path).fingerprint
        stats = prof_path[: -len(".profile.json")] + ".qstats.safetensors"
        if os.path.isfile(stats):
            from safetensors import safe_open
            from safetensors.torch import save_file

            with safe_open(stats, framework="pt") as fh:
                meta = dict(fh.metadata() or {})
                arrays = {n: fh.get_tensor(n) for n in fh.keys()}
            if meta.get("fingerprint") != new_fp:
                stale.append(stats)
                if not args.check:
                    meta["fingerprint"] = new_fp
                    replace_with(stats, lambda tmp: save_file(arrays, tmp, metadata=meta))
        for plan_path in sorted(glob.glob(os.path.join(ROOT, "plans", "*.plan.json"))):
            text = open(plan_path, encoding="utf-8").read()
            raw = json.loads(text)
            if raw["provenance"].get("profile_fingerprint") != old_prof.fingerprint and \
                    raw["provenance"].get("profile_fingerprint") != new_prof_fp:
                continue  # solved from another profile
            new_text = text
            if raw["model"] and raw["model"].get("fingerprint"):
                new_text = _replace_all(new_text, raw["model"]["fingerprint"], new_fp, plan_path)
            new_text = _replace_all(new_text, raw["provenance"]["profile_fingerprint"], new_prof_fp, plan_path)
            if new_text != text:
                stale.append(plan_path)
                if not args.check:
                    write_text_atomic(plan_path, new_text)
    for path in stale:
        print(("stale: " if args.check else "re-stamped: ") + os.path.relpath(path, ROOT))
    print(f"model fingerprint {new_fp}; {len(stale)} file(s) {'stale' if args.check else 're-stamped'}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
