"""Profiles: per-layer sensitivity tables measured offline, the only input a solver reads.

A :class:`Profile` holds the model's shape and fingerprint, the candidate configs (rule, phase,
keep ratio, K bits, V bits), one or more metric tables ``metric[layer, config]`` (lower is better,
e.g. ``"l2"``: MoE-nD's relative attention-output error, or ``"kl"``), optional named statistic
tables with their own column labels (PolyKV's per-(layer, rule) cosine or delta-PPL at a common
calibration capacity, per-layer attention entropy), the quantizer its quantized configs were
measured with (name and parameters; a file without one means KIVI with its defaults), and
provenance. The file is plain JSON (``schema_version`` 1), one config or table row per line; see
``docs/profiles.md``. Loading is strict: every error is a :class:`~polykv.errors.ProfileError` naming the file and the field.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from typing import Any, Iterable, Mapping, Sequence

import attrs
import numpy as np

from polykv.atomic import write_text_atomic
from polykv.errors import ProfileError
from polykv.models.geometry import fingerprints_match
from polykv.plan import DEFAULT_QUANTIZER
from polykv.profiling.profile_checks import (SCHEMA_VERSION, check, profile_error, raise_profile_error,
                                             read_head_tables)
from polykv.profiling.profile_writing import FORMAT, dumps, to_dict
from polykv.strict_json import FieldReader

@attrs.define(frozen=True, kw_only=True)
class CandidateConfig:
    """One candidate per-layer setting: a rule at a keep ratio, in a phase, with K/V bit widths."""

    rule: str
    """Registered retention rule name (``"full"`` only with keep 1.0)."""
    keep: float
    """Fraction of the context kept, in (0, 1]; 1.0 keeps everything (the plan says rule 'full')."""
    phase: str = "both"
    """Phase the rule runs in: ``"prefill"``, ``"decode"`` or ``"both"``."""
    k_bits: int = 16
    """Key width (16 = unquantized)."""
    v_bits: int = 16
    """Value width (16 = unquantized)."""
    params: dict[str, Any] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))
    """Rule parameters used at calibration; copied into the plan's op."""
    k_rank: int | None = None
    """Channels of the key codes (the low-rank axis, ``LayerPlan.k_rank``); None = full width."""
    v_rank: int | None = None
    """Channels of the value codes; None = full width."""

    @property
    def label(self) -> str:
        """``rule@keep/phase/K<k>V<v>`` (``/R<k_rank>x<v_rank>`` added with a rank, ``d`` = full width), unique
        within a profile."""
        extra = "" if not self.params else json.dumps(self.params, sort_keys=True, separators=(",", ":"))
        return f"{self.rule}@{self.keep:g}/{self.phase}/K{self.k_bits}V{self.v_bits}{self.rank_label}{extra}"

    @property
    def low_rank(self) -> bool:
        return self.k_rank is not None or self.v_rank is not None

    @property
    def rank_label(self) -> str:
        """``/R<k>x<v>`` (``d``: full width), empty at full rank."""
        if not self.low_rank:
            return ""
        return "/R" + "x".join("d" if r is None else str(r) for r in (self.k_rank, self.v_rank))

    @property
    def base(self) -> "CandidateConfig":
        """The same config at full rank (the (rule, keep, bits) part of the additive model)."""
        return attrs.evolve(self, k_rank=None, v_rank=None) if self.low_rank else self

    @property
    def keeps_everything(self) -> bool:
        return self.keep >= 1.0


@attrs.define(frozen=True, kw_only=True)
class ProfileModel:
    """The model a profile was measured on (enough for the nominal bytes model and plan headers)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None
    model_type: str = "unknown"
    fingerprint: str | None = None
    """:func:`polykv.models.geometry.fingerprint` of the model; None when unknown (matches any model)."""
    geometry: dict[str, Any] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))
    """Full :meth:`polykv.models.geometry.ModelGeometry.summary` when the profile came from a model."""


@attrs.define(frozen=True, kw_only=True, eq=False)
class StatTable:
    """A named per-layer statistic with its own column labels (e.g. one column per rule)."""

    columns: tuple[str, ...] = attrs.field(converter=tuple)
    """Column labels: rule names for per-(layer, rule) statistics, e.g. ``("entropy",)`` otherwise."""
    values: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.float64))
    """[L, len(columns)] float64."""
    higher_is_better: bool
    """True for cosine similarity, False for delta-PPL or errors."""
    phase: str = "both"
    """Phase the statistic was measured in."""
    capacity: int | None = None
    """Common calibration capacity in tokens (PolyKV uses 256), when one applies."""
    description: str = ""


@attrs.define(frozen=True, kw_only=True, eq=False)
class PairTable:
    """The measured error of sharing adjacent layer pairs (MiniCache, ``LayerPlan.share`` on the upper layer)."""

    uppers: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    """Upper layer l of each measured pair (l - 1, l), ascending."""
    values: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.float64).reshape(-1, 2))
    """[len(uppers), 2] float64: the relative L2 error of the lower and of the upper layer's attention output with
    the pair shared (:mod:`polykv.profiling.share_error`), both layers otherwise keeping everything at 16 bits."""
    share_params: dict[str, Any] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))
    """The merge parameters measured with (empty: the defaults); a plan sharing a pair uses them."""
    description: str = ""

    @property
    def loss(self) -> np.ndarray:
        """[len(uppers)] the pair's loss in the additive model: the sum of both layers' errors."""
        return self.values.sum(axis=1)


@attrs.define(frozen=True, kw_only=True)
class ProfileProvenance:
    corpus: str = ""
    """What the calibration ran on (name, number of sequences, lengths)."""
    seed: int | None = None
    context_tokens: int | None = None
    """Calibration sequence length."""
    versions: dict[str, str] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))
    """Package versions (polykv, torch, transformers, ...)."""
    created: str | None = None
    """ISO-8601 UTC time."""
    note: str = ""
    dtype: str | None = None
    """Compute dtype of the calibration run (``float32``, ``bfloat16``, ``float16``); None when unrecorded."""
    extends: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(str(x) for x in (v or ())))
    """Fingerprints of the profiles this one extends (:mod:`polykv.profiling.merge`, ``calibrate --extend``),
    oldest first: their tables are columns of this one, so a plan solved from them keeps its predicted loss here."""

    def knows(self, fingerprint: str | None) -> bool:
        """Whether a plan solved from the profile ``fingerprint`` was solved from one this profile extends."""
        return fingerprint is not None and fingerprint in self.extends


@attrs.define(frozen=True, kw_only=True, eq=False)
class Profile:
    """Sensitivity tables of one model; see the module docstring. Checked on construction."""

    model: ProfileModel
    configs: tuple[CandidateConfig, ...] = attrs.field(converter=tuple)
    metrics: dict[str, np.ndarray] = attrs.field(
        converter=lambda d: {str(k): np.asarray(v, dtype=np.float64) for k, v in dict(d).items()})
    """Metric name -> [L, C] table, lower is better."""
    stats: dict[str, StatTable] = attrs.field(factory=dict, converter=dict)
    provenance: ProfileProvenance = ProfileProvenance()
    quantizer: str = DEFAULT_QUANTIZER
    """Registered quantizer the configs below 16 bits were measured with; plans solved from the profile use it."""
    quantizer_params: dict[str, Any] = attrs.field(factory=dict, converter=lambda v: dict(v or {}))
    """Its parameters (empty: its defaults)."""
    pairs: PairTable | None = None
    """The error of sharing each adjacent layer pair (None: not measured; the layer axis is not routed)."""
    routing_metric: str | None = None
    """The metric solvers route on by default (e.g. ``"kl"`` when calibration measured it end to end); None (every
    profile of before): ``l2`` when present, else the first by name."""
    objective_weights: dict[str, float] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else dict(v))
    """Metric table -> weight of the calibration objectives mixed into the table ``kl_mix`` (its values are
    ``sum w * table``; :mod:`polykv.profiling.objectives`); None (every profile of before): no mix."""
    head_metrics: dict[str, np.ndarray] | None = attrs.field(default=None, converter=lambda d: None if d is None else {
        str(k): np.asarray(v, dtype=np.float64) for k, v in dict(d).items()})
    """Metric -> [L, Hkv, C] loss of each config with only that KV head compressed; None: not measured."""
    schema_version: int = SCHEMA_VERSION
    source: str = attrs.field(default="<profile>", eq=False, repr=False)
    """File the profile was read from (for error messages)."""
    _fingerprint: str | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        check(self, self.source)

    # -- access ----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def quantizer_fields(self) -> dict[str, Any]:
        """``quantizer`` and ``quantizer_params`` for the plan layers solved from this profile."""
        return {"quantizer": self.quantizer, "quantizer_params": dict(self.quantizer_params)}

    @property
    def default_metric(self) -> str:
        """The routing metric: :attr:`routing_metric` when set, else ``"l2"`` when present, else the first by name."""
        if self.routing_metric is not None:
            return self.routing_metric
        return "l2" if "l2" in self.metrics else sorted(self.metrics)[0]

    def table(self, metric: str | None = None) -> np.ndarray:
        """The [L, C] table of ``metric`` (default: :attr:`default_metric`, the profile's routing metric)."""
        name = metric or self.default_metric
        if name not in self.metrics:
            raise_profile_error(self.source, f"metrics.{name}", "no such metric table",
                  f"this profile has: {', '.join(sorted(self.metrics))}")
        return self.metrics[name]

    @property
    def axes(self) -> tuple[str, ...]:
        """The KV axes the profile measured: ``tokens`` and ``bits`` always, ``rank`` with low-rank configs,
        ``layers`` with a pair table."""
        return ("tokens", "bits") + (("rank",) if any(c.low_rank for c in self.configs) else ()) + (
            ("layers",) if self.pairs is not None else ())

    def without_axes(self) -> "Profile":
        """This profile with only its full-rank configs and no pair table (for solvers that route tokens and bits
        only); it keeps this profile's fingerprint, the plans solved from it name this file."""
        if len(self.axes) == 2:
            return self
        cols = [i for i, c in enumerate(self.configs) if not c.low_rank]
        out = attrs.evolve(self, configs=[self.configs[i] for i in cols], pairs=None,
                           metrics={k: v[:, cols] for k, v in self.metrics.items()}, head_metrics=None if
                           self.head_metrics is None else {k: v[:, :, cols] for k, v in self.head_metrics.items()})
        object.__setattr__(out, "_fingerprint", self.fingerprint)
        return out

    def stat(self, name: str) -> StatTable:
        if name not in self.stats:
            raise_profile_error(self.source, f"stats.{name}", "no such statistic table",
                  f"this profile has: {', '.join(sorted(self.stats)) or '(none)'}")
        return self.stats[name]

    @property
    def fingerprint(self) -> str:
        """``prof-<12 hex>``: digest of the profile's content (provenance excluded), computed once."""
        if self._fingerprint is None:
            d = to_dict(self, tables=False)
            d.pop("provenance")
            h = hashlib.sha256(json.dumps(d, sort_keys=True, allow_nan=False).encode())
            for name in sorted(self.metrics):
                h.update(name.encode() + self.metrics[name].astype("<f8").tobytes())
            for name in sorted(self.stats):
                h.update(name.encode() + self.stats[name].values.astype("<f8").tobytes())
            if self.pairs is not None:  # profiles without a pair table hash exactly as before it existed
                h.update(b"pairs" + self.pairs.values.astype("<f8").tobytes())
            h.update(b"".join(b"heads" + n.encode() + self.head_metrics[n].astype("<f8").tobytes()  # none: no bytes
                              for n in sorted(self.head_metrics or {})))
            object.__setattr__(self, "_fingerprint", "prof-" + h.hexdigest()[:12])
        return self._fingerprint

    def check_model(self, geometry: Any) -> "Profile":
        """Raise ProfileError unless this profile was measured on ``geometry`` (a ModelGeometry)."""
        check_measured_on(self.model, geometry, self.source)
        return self

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_table(cls, table: Any, configs: Iterable[Any], geometry_or_dims: Any, *, metric: str = "l2",
                   stats: Mapping[str, StatTable] | None = None,
                   provenance: ProfileProvenance | None = None) -> "Profile":
        """A profile from a table measured elsewhere.

        Parameters
        ----------
        table : array-like, [L, C]
            Loss of config c applied to layer l alone (lower is better).
        configs : iterable of CandidateConfig, dicts of its fields, or (rule, phase, keep, k_bits, v_bits)
            One per column of ``table``.
        geometry_or_dims : ModelGeometry, dict with num_layers / num_kv_heads / head_dim, or (L, Hkv, d)
        """
        cfgs = tuple(_as_config(c) for c in configs)
        return cls(model=model_info(geometry_or_dims), configs=cfgs, metrics={metric: table},
                   stats=dict(stats or {}), provenance=provenance or ProfileProvenance(created=now_iso()))

    # -- files -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return dumps(self)

    def save(self, path: str) -> None:
        """Write atomically (temp file + rename)."""
        write_text_atomic(path, dumps(self))


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def model_info(geometry_or_dims: Any) -> ProfileModel:
    """A :class:`ProfileModel` from a ModelGeometry, a ProfileModel, a dict or ``(L, Hkv, d)``."""
    g = geometry_or_dims
    if isinstance(g, ProfileModel):
        return g
    if isinstance(g, (tuple, list)) and len(g) == 3:
        return ProfileModel(num_layers=int(g[0]), num_kv_heads=int(g[1]), head_dim=int(g[2]))
    if isinstance(g, Mapping):
        known = {f.name for f in attrs.fields(ProfileModel)}
        return ProfileModel(**{k: v for k, v in g.items() if k in known})
    if all(hasattr(g, a) for a in ("num_layers", "num_kv_heads", "head_dim", "summary")):
        return ProfileModel(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                            num_heads=g.num_heads, model_type=g.model_type, fingerprint=g.fingerprint,
                            geometry=json.loads(json.dumps(g.summary(), default=str)))
    raise ProfileError(f"cannot read model dimensions from {type(g).__name__}: pass a ModelGeometry, a dict with "
                       "num_layers, num_kv_heads and head_dim, or a (layers, kv_heads, head_dim) tuple")


def _as_config(c: Any) -> CandidateConfig:
    if isinstance(c, CandidateConfig):
        return c
    if isinstance(c, Mapping):
        return CandidateConfig(**c)
    rule, phase, keep, kb, vb = c
    return CandidateConfig(rule=rule, phase=phase, keep=float(keep), k_bits=int(kb), v_bits=int(vb))


def moend_configs(rule: str, phase: str = "both", *, keeps: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
                  k_bits: Sequence[int] = (16, 8, 4), v_bits: Sequence[int] = (16, 8, 4)) -> list[CandidateConfig]:
    """MoE-nD's design space for one rule: keep x K bits x V bits (54 configs by default)."""
    return [CandidateConfig(rule=rule, phase=phase, keep=float(k), k_bits=kb, v_bits=vb)
            for k in keeps for kb in k_bits for vb in v_bits]


def check_measured_on(model: ProfileModel, geometry: Any, source: str) -> None:
    """Raise ProfileError (naming ``source``) unless a profile of ``model`` was measured on ``geometry``."""
    for field in ("num_layers", "num_kv_heads", "head_dim"):
        if getattr(model, field) != getattr(geometry, field):
            raise_profile_error(source, f"model.{field}", f"the profile was measured on {field}={getattr(model, field)} "
                                f"but the model has {getattr(geometry, field)}", "calibrate a profile for this model")
    if not fingerprints_match(model.fingerprint, getattr(geometry, "fingerprint", None)):
        raise_profile_error(source, "model.fingerprint", f"the profile was measured on model {model.fingerprint} but "
                            f"this model is {geometry.fingerprint}", "calibrate a profile for this model (polykv calibrate)")


# -- reading files ----------------------------------------------------------------------------------

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
        return f'"format": "{FORMAT}"'.encode() in fh.read(4096)


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
                                                                   "routing_metric", "objective_weights", "pairs",
                                                                   "head_metrics"])
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
    return Profile(pairs=pairs, routing_metric=routing, objective_weights=weights, model=model, configs=configs,
                   metrics=metrics, stats=stats, provenance=prov, head_metrics=read_head_tables(r, raw.get("head_metrics")),
                   quantizer=qraw["name"], quantizer_params=r.dict_(qraw.get("params", {}), "quantizer.params"),
                   schema_version=version, source=source)
