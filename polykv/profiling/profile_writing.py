"""Profile files, written: stable JSON text, one config or table row per line (see ``docs/profiles.md``).

The writer reads a profile's records by their fields and needs nothing of :mod:`polykv.profiling.profile`, which
calls it (:attr:`Profile.fingerprint`, :meth:`Profile.save`) and reads files back.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import attrs

from polykv.plan import DEFAULT_QUANTIZER

if TYPE_CHECKING:
    from polykv.profiling.profile import CandidateConfig, PairTable, Profile

FORMAT = "polykv-profile"
"""The ``format`` field of every profile file."""


def to_dict(p: Profile, *, tables: bool = True) -> dict[str, Any]:
    """Plain data of a profile; ``tables=False`` leaves out the table values (shapes stay implied).

    ``quantizer`` is written only when it is not KIVI with its defaults, so such profiles read (and
    fingerprint) exactly as before the field existed; so are configs' ranks (only when set) and the pair table
    (only when measured).
    """
    quantizer = {}
    if p.quantizer != DEFAULT_QUANTIZER or p.quantizer_params:
        quantizer = {"quantizer": {"name": p.quantizer, "params": dict(sorted(p.quantizer_params.items()))}}
    routing = {} if p.routing_metric is None else {"routing_metric": p.routing_metric}
    if p.objective_weights is not None:
        routing["objective_weights"] = dict(sorted(p.objective_weights.items()))
    return {
        "schema_version": p.schema_version,
        "format": FORMAT,
        **quantizer,
        **routing,
        "model": attrs.asdict(p.model),
        "configs": [_config_dict(c) for c in p.configs],
        "metrics": {k: p.metrics[k].tolist() if tables else None for k in sorted(p.metrics)},
        "stats": {k: {"columns": list(s.columns), "higher_is_better": s.higher_is_better, "phase": s.phase,
                      "capacity": s.capacity, "description": s.description,
                      "values": s.values.tolist() if tables else None}
                  for k, s in sorted(p.stats.items())},
        **({} if p.pairs is None else {"pairs": _pairs_dict(p.pairs, tables)}),
        **({} if p.head_metrics is None else {"head_metrics": {k: p.head_metrics[k].tolist() if tables else None
                                                              for k in sorted(p.head_metrics)}}),
        "provenance": _provenance_dict(p.provenance),
    }


def _provenance_dict(prov) -> dict[str, Any]:
    """The provenance as JSON data; ``extends`` only when the profile extends another (files of before stay as
    they were)."""
    out = attrs.asdict(prov)
    out["extends"] = list(out["extends"])
    if not out["extends"]:
        del out["extends"]
    return out


def _pairs_dict(t: PairTable, tables: bool) -> dict[str, Any]:
    return {"uppers": list(t.uppers), "share_params": dict(sorted(t.share_params.items())),
            "description": t.description, "values": t.values.tolist() if tables else None}


def _config_dict(c: CandidateConfig) -> dict[str, Any]:
    out = {"rule": c.rule, "phase": c.phase, "keep": c.keep, "k_bits": c.k_bits, "v_bits": c.v_bits}
    if c.params:
        out["params"] = dict(sorted(c.params.items()))
    for name in ("k_rank", "v_rank"):
        if getattr(c, name) is not None:
            out[name] = getattr(c, name)
    return out


def dumps(p: Profile) -> str:
    """Stable JSON text: one config or table row per line; floats round-trip exactly."""
    enc = lambda v: json.dumps(v, ensure_ascii=False, allow_nan=False)  # noqa: E731
    d = to_dict(p)

    def rows(items: list, indent: str) -> str:
        return "[\n" + ",\n".join(indent + "  " + enc(r) for r in items) + "\n" + indent + "]"

    lines = ["{"]
    for key in ("schema_version", "format", "quantizer", "routing_metric", "objective_weights", "model", "provenance"):
        if key in d:
            lines.append(f"  {enc(key)}: {enc(d[key])},")
    lines.append(f'  "configs": {rows(d["configs"], "  ")},')
    metric_rows = [f"    {enc(k)}: {rows(v, '    ')}" for k, v in d["metrics"].items()]
    lines.append('  "metrics": {\n' + ",\n".join(metric_rows) + "\n  },")
    stat_rows = []
    for k, s in d["stats"].items():
        head = enc({key: val for key, val in s.items() if key != "values"})[1:-1]
        stat_rows.append(f"    {enc(k)}: {{{head}, \"values\": {rows(s['values'], '      ')}}}")
    lines.append('  "stats": {' + ("\n" + ",\n".join(stat_rows) + "\n  " if stat_rows else "") + "}"
                 + ("," if "pairs" in d or "head_metrics" in d else ""))
    if "pairs" in d:
        head = enc({key: val for key, val in d["pairs"].items() if key != "values"})[1:-1]
        lines.append(f'  "pairs": {{{head}, "values": {rows(d["pairs"]["values"], "    ")}}}'
                     + ("," if "head_metrics" in d else ""))
    if "head_metrics" in d:  # one layer's [KV heads][configs] per line
        tables = [f"    {enc(k)}: " + rows(v, "    ") for k, v in d["head_metrics"].items()]
        lines.append('  "head_metrics": {\n' + ",\n".join(tables) + "\n  }")
    lines.append("}")
    return "\n".join(lines) + "\n"
