"""Profile files: stable JSON writing and strict reading (see ``docs/profiles.md``).

Every reading error is a :class:`~polykv.errors.ProfileError` naming the file and the dotted field.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import attrs
import numpy as np

from polykv.errors import ProfileError
from polykv.plan import DEFAULT_QUANTIZER
from polykv.profiling.profile import (FORMAT, SCHEMA_VERSION, CandidateConfig, Profile, ProfileModel,
                                      ProfileProvenance, StatTable, raise_profile_error)


# -- files ------------------------------------------------------------------------------------------

def to_dict(p: Profile, *, tables: bool = True) -> dict[str, Any]:
    """Plain data of a profile; ``tables=False`` leaves out the table values (shapes stay implied).

    ``quantizer`` is written only when it is not KIVI with its defaults, so such profiles read (and
    fingerprint) exactly as before the field existed.
    """
    quantizer = {}
    if p.quantizer != DEFAULT_QUANTIZER or p.quantizer_params:
        quantizer = {"quantizer": {"name": p.quantizer, "params": dict(sorted(p.quantizer_params.items()))}}
    return {
        "schema_version": p.schema_version,
        "format": FORMAT,
        **quantizer,
        "model": attrs.asdict(p.model),
        "configs": [_config_dict(c) for c in p.configs],
        "metrics": {k: p.metrics[k].tolist() if tables else None for k in sorted(p.metrics)},
        "stats": {k: {"columns": list(s.columns), "higher_is_better": s.higher_is_better, "phase": s.phase,
                      "capacity": s.capacity, "description": s.description,
                      "values": s.values.tolist() if tables else None}
                  for k, s in sorted(p.stats.items())},
        "provenance": attrs.asdict(p.provenance),
    }


def _config_dict(c: CandidateConfig) -> dict[str, Any]:
    out = {"rule": c.rule, "phase": c.phase, "keep": c.keep, "k_bits": c.k_bits, "v_bits": c.v_bits}
    if c.params:
        out["params"] = dict(sorted(c.params.items()))
    return out


def dumps(p: Profile) -> str:
    """Stable JSON text: one config or table row per line; floats round-trip exactly."""
    enc = lambda v: json.dumps(v, ensure_ascii=False, allow_nan=False)  # noqa: E731
    d = to_dict(p)

    def rows(items: list, indent: str) -> str:
        return "[\n" + ",\n".join(indent + "  " + enc(r) for r in items) + "\n" + indent + "]"

    lines = ["{"]
    for key in ("schema_version", "format", "quantizer", "model", "provenance"):
        if key in d:
            lines.append(f"  {enc(key)}: {enc(d[key])},")
    lines.append(f'  "configs": {rows(d["configs"], "  ")},')
    metric_rows = [f"    {enc(k)}: {rows(v, '    ')}" for k, v in d["metrics"].items()]
    lines.append('  "metrics": {\n' + ",\n".join(metric_rows) + "\n  },")
    stat_rows = []
    for k, s in d["stats"].items():
        head = enc({key: val for key, val in s.items() if key != "values"})[1:-1]
        stat_rows.append(f"    {enc(k)}: {{{head}, \"values\": {rows(s['values'], '      ')}}}")
    lines.append('  "stats": {' + ("\n" + ",\n".join(stat_rows) + "\n  " if stat_rows else "") + "}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_profile(path: str) -> Profile:
    """Read a profile file strictly; every problem is a ProfileError naming the file and field."""
    source = str(path)
    from polykv.atomic import MAX_DOCUMENT_BYTES, check_readable_file
    from polykv.errors import OutputError

    try:
        check_readable_file(source, "profile file", max_bytes=MAX_DOCUMENT_BYTES)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ProfileError(f"{source}: no such file (check the path, or run polykv calibrate)") from None
    except OutputError as exc:
        raise ProfileError(str(exc)) from None
    except UnicodeDecodeError:
        raise ProfileError(f"{source}: not a UTF-8 text file; give a profile written by polykv calibrate") from None
    except OSError as exc:
        raise ProfileError(f"{source}: cannot read the profile ({exc.strerror}); check the path and its "
                           "permissions") from None
    return loads(text, source)


def is_profile_file(path: str) -> bool:
    """True when ``path`` looks like a profile polykv wrote (its header names the profile format)."""
    with open(path, "rb") as fh:
        head = fh.read(4096)
    return f'"format": "{FORMAT}"'.encode() in head


def loads(text: str, source: str = "<profile>") -> Profile:
    from polykv.strict_json import JsonInputError, loads_strict

    try:
        raw = loads_strict(text)
    except JsonInputError as exc:
        where = f" at line {exc.line}, column {exc.column}" if exc.line else ""
        raise_profile_error(source, None, f"malformed JSON{where}: {exc.message}")
    return from_dict(raw, source)


def _obj(source: str, raw: Any, field: str, required: Iterable[str], optional: Iterable[str]) -> dict:
    if not isinstance(raw, dict):
        raise_profile_error(source, field or None, f"expected a JSON object, got {type(raw).__name__}")
    required, allowed = list(required), set(required) | set(optional)
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise_profile_error(source, field or None, f"unknown key(s) {unknown}", f"allowed keys: {sorted(allowed)}")
    for key in required:
        if key not in raw:
            raise_profile_error(source, f"{field}.{key}" if field else key, "missing required key")
    return raw


def _num_table(source: str, field: str, raw: Any) -> np.ndarray:
    if not isinstance(raw, list) or not all(isinstance(r, list) for r in raw):
        raise_profile_error(source, field, "expected a list of rows, each a list of numbers")
    width = {len(r) for r in raw}
    if len(width) > 1:
        raise_profile_error(source, field, f"rows have different lengths {sorted(width)}", "every row needs one value per column")
    for i, r in enumerate(raw):
        for j, v in enumerate(r):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise_profile_error(source, f"{field}[{i}][{j}]", f"expected a number, got {v!r}")
    return np.asarray(raw, dtype=np.float64).reshape(len(raw), width.pop() if width else 0)


def from_dict(raw: Any, source: str = "<profile>") -> Profile:
    """Build a profile from parsed JSON, checking every key and type."""
    _obj(source, raw, "", ["schema_version", "model", "configs", "metrics"],
         ["format", "stats", "provenance", "quantizer"])
    if raw["schema_version"] != SCHEMA_VERSION:
        raise_profile_error(source, "schema_version", f"unknown schema version {raw['schema_version']!r}; this polykv reads "
              f"version {SCHEMA_VERSION}", "upgrade polykv or re-save the profile with this version")
    if raw.get("format", FORMAT) != FORMAT:
        raise_profile_error(source, "format", f"expected {FORMAT!r}, got {raw['format']!r}", "is this a plan file?")
    model_fields = [f.name for f in attrs.fields(ProfileModel)]
    mraw = _obj(source, raw["model"], "model", model_fields[:3], model_fields[3:])
    try:
        model = ProfileModel(**mraw)
    except (TypeError, ValueError) as exc:
        raise_profile_error(source, "model", str(exc))
    if not isinstance(raw["configs"], list):
        raise_profile_error(source, "configs", "expected a list of config objects")
    configs = []
    for i, c in enumerate(raw["configs"]):
        f = f"configs[{i}]"
        _obj(source, c, f, ["rule", "keep"], ["phase", "k_bits", "v_bits", "params"])
        for key, kinds in (("rule", str), ("phase", str), ("params", dict), ("k_bits", int), ("v_bits", int)):
            if key in c and (not isinstance(c[key], kinds) or isinstance(c[key], bool)):
                raise_profile_error(source, f"{f}.{key}", f"expected {kinds.__name__}, got {c[key]!r}")
        if isinstance(c["keep"], bool) or not isinstance(c["keep"], (int, float)):
            raise_profile_error(source, f"{f}.keep", f"expected a number in (0, 1], got {c['keep']!r}")
        configs.append(CandidateConfig(**{**c, "keep": float(c["keep"])}))
    _obj(source, raw["metrics"], "metrics", [], raw["metrics"] if isinstance(raw["metrics"], dict) else [])
    metrics = {k: _num_table(source, f"metrics.{k}", v) for k, v in raw["metrics"].items()}
    stats = {}
    sraw = {} if raw.get("stats") is None else raw["stats"]
    _obj(source, sraw, "stats", [], sraw if isinstance(sraw, dict) else [])
    for k, s in sraw.items():
        f = f"stats.{k}"
        _obj(source, s, f, ["columns", "values", "higher_is_better"], ["phase", "capacity", "description"])
        if not isinstance(s["columns"], list) or not all(isinstance(x, str) for x in s["columns"]):
            raise_profile_error(source, f + ".columns", "expected a list of column labels (strings)")
        if not isinstance(s["higher_is_better"], bool):
            raise_profile_error(source, f + ".higher_is_better", f"expected true or false, got {s['higher_is_better']!r}")
        cap = s.get("capacity")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise_profile_error(source, f + ".capacity", f"expected a positive integer or null, got {cap!r}")
        stats[k] = StatTable(columns=s["columns"], values=_num_table(source, f + ".values", s["values"]),
                             higher_is_better=s["higher_is_better"], phase=s.get("phase", "both"),
                             capacity=cap, description=str(s.get("description", "")))
    praw = _obj(source, raw.get("provenance") or {}, "provenance", [],
                [f.name for f in attrs.fields(ProfileProvenance)])
    try:
        prov = ProfileProvenance(**praw)
    except (TypeError, ValueError) as exc:
        raise_profile_error(source, "provenance", str(exc))
    qraw = _obj(source, raw.get("quantizer", {"name": DEFAULT_QUANTIZER}), "quantizer", ["name"], ["params"])
    if not isinstance(qraw["name"], str) or not qraw["name"]:
        raise_profile_error(source, "quantizer.name", f"expected a quantizer name, got {qraw['name']!r}")
    if not isinstance(qraw.get("params", {}), dict):
        raise_profile_error(source, "quantizer.params", f"expected an object, got {qraw['params']!r}")
    return Profile(model=model, configs=configs, metrics=metrics, stats=stats, provenance=prov,
                   quantizer=qraw["name"], quantizer_params=qraw.get("params", {}),
                   schema_version=raw["schema_version"], source=source)
