"""Record in a profile's provenance note the parameters every calibrated rule ran with.

Calibration builds each rule with its registered defaults; for a wrapping rule that includes the
rule it wraps (e.g. ``{"rule": "streamingllm"}``), and for a rule that has an allocator of the same
name the profile measures only its per-layer selection at a fixed capacity (one layer is compressed
at a time, so there is no group of layers to allocate across). This script writes both facts into
``provenance.note`` so a reader of the profile (and of ``polykv solve`` output) can tell which inner
rules were measured. The provenance is not part of the profile's fingerprint, so plans solved from
the profile still match it. Running it twice leaves the note unchanged.

    python scripts/note_profile_rules.py profiles/smollm2-135m-instruct.profile.json
"""

from __future__ import annotations

import json
import sys

import attrs

from polykv.profiling.profile import load_profile
from polykv.registry import get_registry

MARK = "rules at their registered defaults"


def rules_note(rules, registry) -> str:
    """One sentence per fact: each rule's parameters, then the rules measured without their allocator."""
    params = ", ".join(f"{r} {json.dumps(dict(registry.rule(r).defaults), sort_keys=True)}" for r in rules)
    allocated = [r for r in rules if registry.has("allocator", r)]
    note = f"{MARK}: {params}"
    if allocated:
        note += (f"; {', '.join(allocated)}: per-layer selection at a fixed capacity only (their allocators "
                 f"split a group's budget across layers at run time and are not part of a one-layer profile)")
    return note


def main(path: str) -> int:
    profile = load_profile(path)
    rules = sorted({c.rule for c in profile.configs} - {"full"})
    old = profile.provenance.note or ""
    base = old.split(MARK)[0].rstrip("; ")
    note = "; ".join(p for p in (base, rules_note(rules, get_registry())) if p)
    if note != old:
        before = profile.fingerprint
        profile = attrs.evolve(profile, provenance=attrs.evolve(profile.provenance, note=note))
        assert profile.fingerprint == before
        profile.save(path)
    print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
