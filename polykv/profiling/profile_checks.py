"""The rules every profile obeys, whether built in Python or read from a file (:func:`check`, run by
:class:`~polykv.profiling.profile.Profile` itself): each broken one is a ProfileError naming the file and the field.
The constants those rules name (schema version, phases, bit widths, ...) are defined here, below the records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from polykv.errors import PlanError, ProfileError
from polykv.plan import MAX_CONTEXT_TOKENS, MAX_LOSS
from polykv.plan.sharing import check_share_params

if TYPE_CHECKING:
    from polykv.profiling.profile import PairTable, Profile, ProfileModel, ProfileProvenance

SCHEMA_VERSION = 1
PHASES = ("prefill", "decode", "both")
BITS = (2, 4, 8, 16)
MIN_KEEP = 1e-7
"""Smallest keep ratio: below it a config keeps less than one token of any context a budget may name."""
DTYPES = ("float32", "bfloat16", "float16")
FULL_RULE = "full"
MIX_METRIC = "kl_mix"
"""The metric table mixing several calibration objectives' tables (:attr:`Profile.objective_weights`)."""


def mix_tables(metrics: Mapping[str, Any], weights: Mapping[str, float]) -> np.ndarray:
    """The ``kl_mix`` table: ``sum weights[name] * metrics[name]`` over the weighted tables, in float64."""
    return sum(float(w) * np.asarray(metrics[name], dtype=np.float64) for name, w in sorted(weights.items()))


def profile_error(message: str, *, source: str, field: str | None = None, layer: int | None = None,
                  hint: str | None = None) -> ProfileError:
    """A :class:`ProfileError` naming the file (``source``) and ``field``, with what to do (``hint``)."""
    where = ", ".join(x for x in (source, f"field '{field}'" if field else "") if x)
    return ProfileError(f"{where}: {message}" + (f" ({hint})" if hint else ""))


def raise_profile_error(source: str, field: str | None, message: str, hint: str | None = None):
    raise profile_error(message, source=source, field=field, hint=hint)


def check(p: Profile, source: str) -> None:
    """Every rule a profile obeys, whether built in Python or read from a file."""
    if p.schema_version != SCHEMA_VERSION:
        raise_profile_error(source, "schema_version", f"unknown schema version {p.schema_version!r}; this polykv reads "
              f"version {SCHEMA_VERSION}", "upgrade polykv or re-save the profile with this version")
    m = p.model
    for field in ("num_layers", "num_kv_heads", "head_dim"):
        v = getattr(m, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise_profile_error(source, f"model.{field}", f"must be a positive integer, got {v!r}")
    if not isinstance(p.quantizer, str) or not p.quantizer:
        raise_profile_error(source, "quantizer.name", f"expected a quantizer name, got {p.quantizer!r}")
    if not p.configs:
        raise_profile_error(source, "configs", "the profile lists no candidate configs", "give one config per table column")
    seen: dict[str, int] = {}
    for i, c in enumerate(p.configs):
        f = f"configs[{i}]"
        if not isinstance(c.rule, str) or not c.rule:
            raise_profile_error(source, f + ".rule", f"expected a rule name, got {c.rule!r}")
        if c.phase not in PHASES:
            raise_profile_error(source, f + ".phase", f"unknown phase {c.phase!r}", f"use one of {', '.join(PHASES)}")
        if isinstance(c.keep, bool) or not isinstance(c.keep, (int, float)) or not 0.0 < c.keep <= 1.0:
            raise_profile_error(source, f + ".keep", f"keep ratio must be in (0, 1], got {c.keep!r}")
        if c.keep < MIN_KEEP:
            raise_profile_error(source, f + ".keep", f"keep ratio {c.keep!r} keeps less than one token of any "
                                f"context", f"use at least {MIN_KEEP:g}")
        if c.rule == FULL_RULE and c.keep < 1.0:
            raise_profile_error(source, f + ".keep", f"rule 'full' keeps everything; keep must be 1.0, got {c.keep}")
        for name in ("k_bits", "v_bits"):
            if getattr(c, name) not in BITS:
                raise_profile_error(source, f"{f}.{name}", f"unsupported bit width {getattr(c, name)!r}",
                      "use 16 (unquantized), 8, 4 or 2")
        for name in ("k_rank", "v_rank"):
            _positive_int(source, f"{f}.{name}", getattr(c, name), nullable=True, high=m.head_dim)
        if c.label in seen:
            raise_profile_error(source, f, f"duplicate config {c.label} (also configs[{seen[c.label]}])", "list each config once")
        seen[c.label] = i
    if not p.metrics:
        raise_profile_error(source, "metrics", "the profile has no metric table", "give at least one table, e.g. 'l2'")
    if p.routing_metric is not None and p.routing_metric not in p.metrics:
        raise_profile_error(source, "routing_metric", f"names metric {p.routing_metric!r}, which the profile has no "
                            f"table of", f"use one of {', '.join(sorted(p.metrics))}, or leave the field out")
    shape = (m.num_layers, len(p.configs))
    for name, t in p.metrics.items():
        _check_array(source, f"metrics.{name}", t, shape, "rows are layers, columns are the configs in order")
        _check_range(source, f"metrics.{name}", t, 0.0, "a loss (0 = no error, lower is better)")
    for name, st in p.stats.items():
        f = f"stats.{name}"
        if not st.columns or len(set(st.columns)) != len(st.columns):
            raise_profile_error(source, f + ".columns", f"column labels must be non-empty and unique, got {list(st.columns)}")
        if st.phase not in PHASES:
            raise_profile_error(source, f + ".phase", f"unknown phase {st.phase!r}", f"use one of {', '.join(PHASES)}")
        _check_array(source, f + ".values", st.values, (m.num_layers, len(st.columns)),
                     "rows are layers, columns are the table's column labels")
        _check_range(source, f + ".values", st.values, -MAX_LOSS, "a statistic")
    if p.pairs is not None:
        _check_pairs(source, p.pairs, m.num_layers)
    _check_heads(source, p)
    _check_mix(source, p)
    _check_model(source, m)
    _check_provenance(source, p.provenance)


def _check_mix(source: str, p: Profile) -> None:
    """``objective_weights`` names metric tables (not the mix itself) with finite weights >= 0, not all 0, and the
    table ``kl_mix`` is their weighted sum; a ``kl_mix`` table needs the weights."""
    weights = p.objective_weights
    if weights is None:
        if MIX_METRIC in p.metrics:
            raise_profile_error(source, f"metrics.{MIX_METRIC}", "the objective mix table has no objective_weights",
                                "give objective_weights (metric table -> weight), or rename the table")
        return
    if not weights:
        raise_profile_error(source, "objective_weights", "no weights", "give each mixed metric table a weight, or "
                            "leave the field out")
    for name, w in weights.items():
        field = f"objective_weights.{name}"
        if name == MIX_METRIC or name not in p.metrics:
            raise_profile_error(source, field, f"names metric {name!r}, which is not a table the mix can read",
                                f"use the profile's tables: {', '.join(sorted(set(p.metrics) - {MIX_METRIC}))}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
            raise_profile_error(source, field, f"weight {w!r} is not a finite number >= 0", "use e.g. 1.0")
    if not any(weights.values()):
        raise_profile_error(source, "objective_weights", "every weight is 0", "give one table a positive weight")
    if MIX_METRIC not in p.metrics:
        raise_profile_error(source, f"metrics.{MIX_METRIC}", "missing: objective_weights mix the tables into it",
                            "re-run polykv calibrate, or leave objective_weights out")
    expected = mix_tables(p.metrics, weights)
    if expected.shape == p.metrics[MIX_METRIC].shape and not np.allclose(p.metrics[MIX_METRIC], expected,
                                                                         rtol=1e-9, atol=1e-12):
        raise_profile_error(source, f"metrics.{MIX_METRIC}", "is not the objective_weights' weighted sum of "
                            f"{', '.join(sorted(weights))}", "re-run polykv calibrate; edit no table by hand")


def _check_pairs(source: str, pairs: PairTable, num_layers: int) -> None:
    """Pairs name upper layers 1..L-1, ascending, once each, with one finite (lower, upper) error each."""
    ups = list(pairs.uppers)
    bad = [u for u in ups if not 1 <= u < num_layers]
    if bad or ups != sorted(set(ups)) or not ups:
        raise_profile_error(source, "pairs.uppers", f"expected distinct ascending upper layers in 1..{num_layers - 1}, "
                            f"got {ups}", "name each measured pair (l - 1, l) once by its upper layer l")
    _check_array(source, "pairs.values", pairs.values, (len(ups), 2), "one row per pair: [lower error, upper error]")
    _check_range(source, "pairs.values", pairs.values, 0.0, "a loss (0 = no error, lower is better)")
    try:
        check_share_params(pairs.share_params, layer=ups[0], source=source)
    except PlanError as exc:
        raise_profile_error(source, "pairs.share_params", str(exc))


def read_head_tables(r, raw: Any) -> dict[str, np.ndarray] | None:
    """``head_metrics`` of a profile file (metric -> [L][Hkv][C] nested lists of numbers) as arrays; None when
    absent. ``r`` is the file's :class:`~polykv.strict_json.FieldReader`."""
    if raw is None:
        return None
    out = {}
    for name, table in r.dict_(raw, "head_metrics").items():
        field = f"head_metrics.{name}"
        try:
            a = np.asarray(table, dtype=np.float64)
        except (TypeError, ValueError):
            a = None
        if a is None or a.ndim != 3 or _has_bools(table):
            r.fail("expected [layers][KV heads][configs] nested lists of numbers", field=field,
                   hint="one row per KV head in each layer, one value per config")
        out[name] = a
    return out


def _has_bools(x: Any) -> bool:
    return isinstance(x, bool) or (isinstance(x, list) and any(_has_bools(v) for v in x))


def _check_heads(source: str, p: "Profile") -> None:
    """``head_metrics``: each names a metric table of the profile, [L, Hkv, C], finite losses >= 0."""
    m = p.model
    for name, t in (p.head_metrics or {}).items():
        field = f"head_metrics.{name}"
        if name not in p.metrics:
            raise_profile_error(source, field, f"names metric {name!r}, which the profile has no table of",
                                f"use one of {', '.join(sorted(p.metrics))}, or drop the per-head table")
        shape = (m.num_layers, m.num_kv_heads, len(p.configs))
        if t.shape != shape:
            raise_profile_error(source, field, f"expected shape {list(shape)}, got {list(t.shape)}",
                                "layers x KV heads x configs in order")
        bad = np.argwhere(~np.isfinite(t) | (t < 0) | (t > MAX_LOSS))
        if len(bad):
            l, h, c = (int(x) for x in bad[0])
            raise_profile_error(source, field, f"value {t[l, h, c]} at layer {l}, KV head {h}, column {c} is not a "
                                f"loss ({len(bad)} such values)", f"every value must lie in [0, {MAX_LOSS:g}]")


def _check_range(source: str, field: str, a: np.ndarray, low: float, what: str) -> None:
    bad = np.argwhere((a < low) | (a > MAX_LOSS))
    if len(bad):
        l, c = (int(x) for x in bad[0])
        raise_profile_error(source, field, f"value {a[l, c]:g} at layer {l}, column {c} is not {what} "
                            f"({len(bad)} such values)", f"every value must lie in [{low:g}, {MAX_LOSS:g}]; re-measure "
                            "or drop the config")


def _positive_int(source: str, field: str, v: Any, *, nullable: bool, high: int | None = None) -> None:
    if v is None and nullable:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (high is not None and v > high):
        raise_profile_error(source, field, f"must be a positive integer{f' up to {high}' if high else ''}"
                            f"{' or null' if nullable else ''}, got {v!r}")


def _check_model(source: str, m: "ProfileModel") -> None:
    _positive_int(source, "model.num_heads", m.num_heads, nullable=True)
    for name in ("model_type", "fingerprint"):
        v = getattr(m, name)
        if not isinstance(v, str) and not (v is None and name == "fingerprint"):
            raise_profile_error(source, f"model.{name}", f"expected a string, got {v!r}")


def _check_provenance(source: str, prov: "ProfileProvenance") -> None:
    f = "provenance."
    _positive_int(source, f + "context_tokens", prov.context_tokens, nullable=True, high=MAX_CONTEXT_TOKENS)
    if prov.seed is not None and (isinstance(prov.seed, bool) or not isinstance(prov.seed, int) or prov.seed < 0):
        raise_profile_error(source, f + "seed", f"expected a non-negative integer or null, got {prov.seed!r}")
    for name in ("corpus", "note", "created"):
        v = getattr(prov, name)
        if not isinstance(v, str) and not (v is None and name == "created"):
            raise_profile_error(source, f + name, f"expected a string, got {v!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in prov.versions.items()):
        raise_profile_error(source, f + "versions", f"expected package -> version strings, got {prov.versions!r}")
    if prov.dtype is not None and prov.dtype not in DTYPES:
        raise_profile_error(source, f + "dtype", f"unknown dtype {prov.dtype!r}", f"use one of {', '.join(DTYPES)}")


def _check_array(source: str, field: str, a: np.ndarray, shape: tuple[int, int], what: str) -> None:
    if a.size == 0:
        raise_profile_error(source, field, "the table is empty", what)
    if a.shape != shape:
        raise_profile_error(source, field, f"expected shape {list(shape)}, got {list(a.shape)}", what)
    bad = np.argwhere(~np.isfinite(a))
    if len(bad):
        l, c = (int(x) for x in bad[0])
        raise_profile_error(source, field, f"non-finite value {a[l, c]} at layer {l}, column {c} ({len(bad)} in all)",
              "re-measure or drop the config; NaN and infinity are not losses")
