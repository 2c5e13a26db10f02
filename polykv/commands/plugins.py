"""``polykv plugins``: every registered rule, quantizer, solver, task and allocator, and who provides it."""

from __future__ import annotations

import json
from typing import Any

from polykv.registry import get_registry


def register(subparsers) -> None:
    p = subparsers.add_parser("plugins", help="list registered rules, quantizers, solvers and tasks",
                              description="List every registered name with its kind, the plugin (and "
                                          "version) that provides it, and the phases a rule runs in or "
                                          "the bit widths a quantizer stores.")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def describe_entries(registry) -> list[dict[str, Any]]:
    """One dict per registered name, sorted by kind then name."""
    rows = []
    for entry in registry.entries():
        row: dict[str, Any] = {"kind": entry.kind, "name": entry.name, "plugin": entry.plugin,
                               "version": entry.version}
        obj = entry.obj
        if entry.kind == "rule":
            row["phases"] = sorted(getattr(obj, "phases", ()))
            row["signal"] = getattr(obj, "signal", None)
        elif entry.kind == "quantizer":
            row["bits"] = sorted(getattr(obj, "bits", ()))
        paper = getattr(obj, "paper", "")
        if paper:
            row["paper"] = paper
        rows.append(row)
    return rows


def run(args) -> int:
    rows = describe_entries(get_registry())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("KIND", "NAME", "PLUGIN", "VERSION", "PHASES / BITS")
    table = [header]
    for row in rows:
        extra = ""
        if "phases" in row:
            extra = ",".join(row["phases"])
        elif "bits" in row:
            extra = ",".join(str(b) for b in row["bits"])
        table.append((row["kind"], row["name"], row["plugin"], row["version"], extra))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0
