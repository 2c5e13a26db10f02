"""Profile files: stable JSON writing and strict reading (see ``docs/profiles.md``).

Every reading error is a :class:`~polykv.errors.ProfileError` naming the file and the dotted field.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import numpy as np

from polykv.plan import DEFAULT_QUANTIZER
from polykv.profiling.profile import (FORMAT, SCHEMA_VERSION, CandidateConfig, PairTable, Profile, ProfileModel,
                                      ProfileProvenance, StatTable, profile_error)
from polykv.strict_json import FieldReader


# -- files ------------------------------------------------------------------------------------------

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
                 + ("," if "pairs" in d else ""))
    if "pairs" in d:
        head = enc({key: val for key, val in d["pairs"].items() if key != "values"})[1:-1]
        lines.append(f'  "pairs": {{{head}, "values": {rows(d["pairs"]["values"], "    ")}}}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_profile(path: str) -> Profile:
    """Read a profile file strictly; every problem is a ProfileError naming the file and field."""
    source = str(path)
    raw = FieldReader(source, profile_error).read("profile file",
                                                  missing_hint="check the path, or run polykv calibrate",
                                                  text_hint="give a profile written by polykv calibrate")
    return from_dict(raw, source)


def is_profile_file(path: str) -> bool:
    """True when ``path`` looks like a profile polykv wrote (its header names the profile format)."""
    with open(path, "rb") as fh:
        head = fh.read(4096)
    return f'"format": "{FORMAT}"'.encode() in head


def loads(text: str, source: str = "<profile>") -> Profile:
    return from_dict(FieldReader(source, profile_error).parse(text), source)


def _num_table(r: FieldReader, field: str, raw: Any) -> np.ndarray:
    if not isinstance(raw, list) or not all(isinstance(row, list) for row in raw):
        r.fail("expected a list of rows, each a list of numbers", field=field)
    width = {len(row) for row in raw}
    if len(width) > 1:
        r.fail(f"rows have different lengths {sorted(width)}", field=field, hint="every row needs one value per column")
    for i, row in enumerate(raw):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                r.fail(f"expected a number, got {v!r}", field=f"{field}[{i}][{j}]")
    return np.asarray(raw, dtype=np.float64).reshape(len(raw), width.pop() if width else 0)


def _attrs_record(r: FieldReader, cls, raw: dict, field: str):
    """``cls(**raw)``, its refusal one error naming ``field``."""
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        r.fail(str(exc), field=field)


def from_dict(raw: Any, source: str = "<profile>") -> Profile:
    """Build a profile from parsed JSON, checking every key and type."""
    r = FieldReader(source, profile_error)
    r.obj(raw, "", ["schema_version", "model", "configs", "metrics"], ["format", "stats", "provenance", "quantizer",
                                                                   "routing_metric", "objective_weights", "pairs"])
    version = raw["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:  # 1.0 and true are not version 1
        r.fail(f"unknown schema version {version!r}; this polykv reads version {SCHEMA_VERSION}",
               field="schema_version", hint="upgrade polykv or re-save the profile with this version")
    if raw.get("format", FORMAT) != FORMAT:
        r.fail(f"expected {FORMAT!r}, got {raw['format']!r}", field="format", hint="is this a plan file?")
    model_fields = [f.name for f in attrs.fields(ProfileModel)]
    model = _attrs_record(r, ProfileModel, r.obj(raw["model"], "model", model_fields[:3], model_fields[3:]), "model")
    configs = []
    for i, c in enumerate(r.list_(raw["configs"], "configs", what="a list of config objects")):
        f = f"configs[{i}]"
        r.obj(c, f, ["rule", "keep"], ["phase", "k_bits", "v_bits", "params", "k_rank", "v_rank"])
        r.str_(c["rule"], f + ".rule")
        r.str_(c.get("phase", ""), f + ".phase")
        r.dict_(c.get("params", {}), f + ".params")
        r.int_(c.get("k_bits", 16), f + ".k_bits")
        r.int_(c.get("v_bits", 16), f + ".v_bits")
        for name in ("k_rank", "v_rank"):
            r.int_(c.get(name), f"{f}.{name}", minimum=1, optional=True)
        if isinstance(c["keep"], bool) or not isinstance(c["keep"], (int, float)):
            r.fail(f"expected a number in (0, 1], got {c['keep']!r}", field=f + ".keep")
        configs.append(CandidateConfig(**{**c, "keep": float(c["keep"])}))
    metrics_raw = r.dict_(raw["metrics"], "metrics")
    metrics = {k: _num_table(r, f"metrics.{k}", v) for k, v in metrics_raw.items()}
    stats = {}
    for k, s in (r.dict_(raw.get("stats"), "stats", optional=True) or {}).items():
        f = f"stats.{k}"
        r.obj(s, f, ["columns", "values", "higher_is_better"], ["phase", "capacity", "description"])
        if not isinstance(s["columns"], list) or not all(isinstance(x, str) for x in s["columns"]):
            r.fail("expected a list of column labels (strings)", field=f + ".columns")
        cap = r.int_(s.get("capacity"), f + ".capacity", minimum=1, optional=True)
        stats[k] = StatTable(columns=s["columns"], values=_num_table(r, f + ".values", s["values"]),
                             higher_is_better=r.bool_(s["higher_is_better"], f + ".higher_is_better"),
                             phase=s.get("phase", "both"), capacity=cap, description=str(s.get("description", "")))
    praw = r.obj(raw.get("provenance") or {}, "provenance", optional=[f.name for f in attrs.fields(ProfileProvenance)])
    prov = _attrs_record(r, ProfileProvenance, praw, "provenance")
    qraw = r.obj(raw.get("quantizer", {"name": DEFAULT_QUANTIZER}), "quantizer", ["name"], ["params"])
    r.str_(qraw["name"], "quantizer.name", nonempty=True)
    routing = raw.get("routing_metric")
    if routing is not None:
        r.str_(routing, "routing_metric", nonempty=True)
    weights = raw.get("objective_weights")
    if weights is not None:
        for name, w in r.dict_(weights, "objective_weights").items():
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                r.fail(f"expected a number, got {w!r}", field=f"objective_weights.{name}",
                       hint="give each mixed metric table a weight >= 0")
    pairs = None
    if raw.get("pairs") is not None:
        praw_ = r.obj(raw["pairs"], "pairs", ["uppers", "values"], ["share_params", "description"])
        ups = r.list_(praw_["uppers"], "pairs.uppers", what="a list of upper layer indices")
        for i, u in enumerate(ups):
            r.int_(u, f"pairs.uppers[{i}]", minimum=1)
        vals = _num_table(r, "pairs.values", praw_["values"])
        if vals.shape != (len(ups), 2):
            r.fail(f"expected shape [{len(ups)}, 2], got {list(vals.shape)}", field="pairs.values",
                   hint="one row per pair: [lower error, upper error]")
        pairs = PairTable(uppers=ups, values=vals, share_params=r.dict_(praw_.get("share_params", {}),
                                                                        "pairs.share_params"),
                          description=str(praw_.get("description", "")))
    return Profile(pairs=pairs, routing_metric=routing, objective_weights=weights, model=model, configs=configs, metrics=metrics, stats=stats, provenance=prov,
                   quantizer=qraw["name"], quantizer_params=r.dict_(qraw.get("params", {}), "quantizer.params"),
                   schema_version=version, source=source)
