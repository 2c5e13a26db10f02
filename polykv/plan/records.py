"""Plans: for every layer and phase, which retention rule runs, how much it keeps, and at how many bits.

A plan is a plain JSON file (``schema_version`` 1), written deterministically so that it diffs well
and round-trips byte for byte: top-level fields one per line, one line per layer. Save with
:meth:`Plan.save` (atomic, :mod:`polykv.plan.writing`), load with :func:`polykv.plan.io.load_plan`. Build plans
in Python with :func:`uniform_plan`, :func:`full_plan` and :func:`per_layer_plan`. The file format is
documented in ``docs/plan-format.md``; :mod:`polykv.plan.io` parses and checks files strictly, and
:func:`polykv.plan.io.validate_plan` checks a plan against the plugins and a model. The records know
neither: the reader and the checks import them, never the other way round.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping, Sequence

import attrs

from polykv.errors import PlanError
from polykv.plan.writing import dumps, save

SCHEMA_VERSION = 1
"""The version a plan file carries when it uses only the token and bit axes (every plan before ranks and sharing)."""
SHARE_SCHEMA_VERSION = 2
"""The schema version of a plan file in which some layer uses ``share`` (files without it stay version 1)."""
RANK_SCHEMA_VERSION = 2
"""The schema version of a plan file in which some layer stores low-rank codes (``k_rank`` / ``v_rank``)."""
SCHEMA_VERSIONS = (SCHEMA_VERSION, SHARE_SCHEMA_VERSION)
"""Versions this polykv reads; a version-1 file's layers are full rank and share nothing."""
FULL_RULE = "full"
DEFAULT_QUANTIZER = "kivi"
PASSTHROUGH_BITS = 16
MAX_CONTEXT_TOKENS = 1 << 24
"""Largest context length a plan, budget or spec may refer to (16M tokens)."""
BUDGET_KINDS = ("bytes", "ratio", "tokens_per_layer")
"""The kinds of memory budget: bytes, a compression ratio, or average tokens per layer."""
MAX_BUDGET_VALUE = 1e18
"""Largest budget value in any unit (an exabyte, or as many tokens): anything above is a typo."""
MAX_LOSS = 1e12
"""Largest loss a profile table or a plan's prediction may hold: a sum of a million layers' errors far
above any measured (relative errors and KL stay below ~100); larger values overflow the solvers' sums."""
MAX_BATCH = 1 << 20
"""Most batch rows a resident budget may be counted for."""
PHASES = ("prefill", "decode")
"""The phases a layer has an op for, in the order they run."""
BASES = ("resident", "nominal")
"""What a budget counts (:attr:`Provenance.basis`): the bytes the runtime holds, or MoE-nD's nominal bytes."""
STORAGE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Storage dtypes a resident budget may be counted in (:attr:`Provenance.cache_dtype`), and their bytes."""


def _plain_value(value: Any, field: str) -> Any:
    """``value`` with numpy scalars (``np.int64(64)``, ``np.float32(0.5)``) as the Python numbers they hold, in
    mappings and lists too, so a plan built from them saves exactly like one built from ints and floats; an array or
    tensor is a PlanError naming ``field`` (a plan holds one number per field)."""
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value.item() if type(value).__module__ == "numpy" else value     # np.float64 subclasses float
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray" and hasattr(value, "item"):
        return value.item()
    if hasattr(value, "shape"):
        raise PlanError(f"{field} must be a plain number (or JSON value), got a {type(value).__module__}."
                        f"{type(value).__name__} of shape {tuple(value.shape)}", field=field,
                        hint="give one number per field: int(x) or float(x)")
    if isinstance(value, Mapping):
        return {k: _plain_value(v, f"{field}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_value(v, f"{field}[{i}]") for i, v in enumerate(value))
    return value


def _plain(field: str):
    return lambda value: _plain_value(value, field)


def _frozen_dict(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


def _params(field: str):
    return lambda value: _plain_value(dict(value or {}), field)


@attrs.define(frozen=True, kw_only=True)
class OpSpec:
    """What one layer does in one phase."""

    rule: str = FULL_RULE
    """Registered retention rule name (``"full"`` keeps everything)."""
    capacity: int | None = attrs.field(default=None, converter=_plain("capacity"))
    """Tokens the layer keeps (an absolute count), or None."""
    capacity_ratio: float | None = attrs.field(default=None, converter=_plain("capacity_ratio"))
    """Fraction of the context the layer keeps, in (0, 1], or None."""
    params: dict[str, Any] = attrs.field(factory=dict, converter=_params("params"))
    """Rule parameters; missing ones take the rule's reference defaults."""

    @property
    def keeps_everything(self) -> bool:
        return self.rule == FULL_RULE

    def resolve_capacity(self, context_tokens: int) -> int | None:
        """Token capacity for a context of ``context_tokens`` tokens (None = unlimited).

        A ratio resolves to ``ceil(ratio * context_tokens)``, at least 1.
        """
        if self.keeps_everything:
            return None
        if self.capacity is not None:
            return self.capacity
        assert self.capacity_ratio is not None
        return max(1, math.ceil(self.capacity_ratio * context_tokens - 1e-9))

    def kept_tokens(self, context_tokens: int) -> int:
        """Tokens this op keeps of a ``context_tokens`` context: its capacity there, at most the context."""
        cap = self.resolve_capacity(context_tokens)
        return context_tokens if cap is None else min(cap, context_tokens)

    def describe(self) -> str:
        if self.keeps_everything:
            return "full"
        cap = f"{self.capacity}" if self.capacity is not None else f"{self.capacity_ratio:g}x"
        return f"{self.rule}@{cap}"


FULL_OP = OpSpec()


def _rank(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanError(f"{attribute.name} must be a whole number of channels >= 1 (or None for full rank), got "
                        f"{value!r}", layer=getattr(instance, "layer", None), field=attribute.name,
                        hint="e.g. half the head dim; the rank may not exceed the head dim")


_optional_rank = attrs.validators.optional(_rank)   # None is full rank


@attrs.define(frozen=True, kw_only=True)
class LayerPlan:
    """One decoder layer: a prefill op, a decode op, and K/V bit widths."""

    layer: int = attrs.field(converter=_plain("layer"))
    """Layer index (must equal the position in the plan's layer list)."""
    prefill: OpSpec = FULL_OP
    """Applied once to the prompt, after prefill attention and before storage."""
    decode: OpSpec = FULL_OP
    """Applied during generation whenever storage exceeds capacity + decode slack."""
    k_bits: int = attrs.field(default=PASSTHROUGH_BITS, converter=_plain("k_bits"))
    """Key storage width; 16 stores keys unquantized in the model's dtype."""
    v_bits: int = attrs.field(default=PASSTHROUGH_BITS, converter=_plain("v_bits"))
    """Value storage width; 16 stores values unquantized in the model's dtype."""
    quantizer: str = DEFAULT_QUANTIZER
    """Registered quantizer used for widths below 16."""
    quantizer_params: dict[str, Any] = attrs.field(factory=dict, converter=_params("quantizer_params"))
    """Quantizer parameters; missing ones take its defaults."""
    share: int | None = attrs.field(default=None, converter=_plain("share"))
    """The layer below (``layer - 1``) whose prompt K/V this layer merges with (MiniCache, see
    ``docs/sharing.md``); set on the upper layer of the pair. None: no sharing."""
    share_params: dict[str, Any] = attrs.field(factory=dict, converter=_params("share_params"))
    """The merge's parameters (``interpolation``, ``retention_ratio``); missing ones take the defaults."""
    k_rank: int | None = attrs.field(default=None, converter=_plain("k_rank"), validator=_optional_rank)
    """Channels of each stored key code ``c = P^T k`` (P: the layer's offline key basis per KV head);
    None stores full-width keys, exactly as without a basis."""
    v_rank: int | None = attrs.field(default=None, converter=_plain("v_rank"), validator=_optional_rank)
    """Channels of each stored value code ``e = U^T v``; None stores full-width values."""

    @property
    def low_rank(self) -> bool:
        """Whether either stream stores projected codes (a basis is needed)."""
        return self.k_rank is not None or self.v_rank is not None

    def rank_of(self, stream: str, head_dim: int) -> int:
        """Channels stored per token of ``stream`` ("key" or "value"): its rank, or ``head_dim``."""
        rank = self.k_rank if stream == "key" else self.v_rank
        return head_dim if rank is None else int(rank)

    @property
    def quantized(self) -> bool:
        return self.k_bits != PASSTHROUGH_BITS or self.v_bits != PASSTHROUGH_BITS

    @property
    def keeps_everything(self) -> bool:
        return (self.prefill.keeps_everything and self.decode.keeps_everything and not self.quantized
                and self.share is None and not self.low_rank)


def _positive_slack(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanError(f"decode_slack must be a whole number of tokens >= 1, got {value!r}",
                        field="trigger.decode_slack",
                        hint="pass decode_slack=1 to evict on every step past capacity, or more to evict less often")


@attrs.define(frozen=True, kw_only=True)
class TriggerSettings:
    """When decode-time eviction fires."""

    decode_slack: int = attrs.field(default=128, converter=_plain("trigger.decode_slack"), validator=_positive_slack)
    """Evict when storage exceeds capacity + slack (1 = evict on every step past capacity)."""


@attrs.define(frozen=True, kw_only=True)
class ModelInfo:
    """The model a plan was made for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    name: str = ""
    fingerprint: str | None = None


@attrs.define(frozen=True, kw_only=True)
class Provenance:
    """Where a plan came from."""

    solver: str | None = None
    """Solver name, or None for a hand-made plan."""
    params: dict[str, Any] = attrs.field(factory=dict, converter=_params("provenance.params"))
    """Solver parameters."""
    budget: dict[str, Any] | None = None
    """The budget as given (e.g. ``{"bytes": ...}``, ``{"ratio": 8}``, ``{"tokens_per_layer": 256}``)."""
    context_tokens: int | None = attrs.field(default=None, converter=_plain("provenance.context_tokens"))
    """Context length the budget and predictions refer to."""
    predicted_loss: float | None = attrs.field(default=None, converter=_plain("provenance.predicted_loss"))
    """Sum of per-layer profile losses the solver predicts."""
    predicted_bytes: int | None = attrs.field(default=None, converter=_plain("provenance.predicted_bytes"))
    """KV bytes the solver predicts at ``context_tokens``, on ``basis`` (nominal when the basis is unstated)."""
    profile_fingerprint: str | None = None
    polykv_version: str | None = None
    created: str | None = None
    """ISO-8601 UTC time."""
    note: str = ""
    basis: str | None = None
    """What the budget counted: ``"resident"`` (bytes the runtime holds, metadata included) or
    ``"nominal"`` (MoE-nD's codes-only formula); None in plans made before bases were recorded (nominal)."""
    batch: int | None = attrs.field(default=None, converter=_plain("provenance.batch"))
    """Batch rows a resident budget was counted for."""
    cache_dtype: str | None = None
    """Storage dtype of unquantized K/V, scales and residuals a resident budget was counted in."""
    measured: dict[str, Any] | None = attrs.field(default=None, converter=_plain("provenance.measured"))
    """What a solver measured end to end on a model (``refine``: every measured move, the exact plan's and the
    final plan's measured KL); None for solvers that only read the profile."""


@attrs.define(frozen=True, kw_only=True)
class AllocationGroup:
    """Layers whose budgets an allocator decides at run time (see :mod:`polykv.contract.allocators`).

    The group's total budget is the sum of its layers' prefill capacities as planned (resolved
    for the context); the allocator redistributes it after prefill. The allocated budget replaces
    the capacity of each group layer's prefill op and, when it evicts, its decode op.
    """

    allocator: str
    """Registered allocator name."""
    layers: tuple[int, ...] = attrs.field(converter=lambda v: _plain_value(tuple(v), "allocation.layers"))
    """Member layers, ascending; each has a prefill rule with a capacity."""
    params: dict[str, Any] = attrs.field(factory=dict, converter=_params("allocation.params"))
    """Allocator parameters; missing ones take its defaults."""

    def describe(self) -> str:
        return f"{self.allocator}[{self.layers[0]}..{self.layers[-1]}]" if self.layers else self.allocator


@attrs.define(frozen=True, kw_only=True)
class Plan:
    """A per-layer, per-phase compression plan."""

    layers: tuple[LayerPlan, ...] = attrs.field(converter=tuple)
    model: ModelInfo | None = None
    trigger: TriggerSettings = TriggerSettings()
    provenance: Provenance = Provenance()
    schema_version: int = SCHEMA_VERSION
    allocation: tuple[AllocationGroup, ...] = attrs.field(default=(), converter=tuple)
    """Allocation groups (none in a plan whose capacities are all fixed)."""
    model_data: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    """Where the per-model data the plan's rules read comes from (:mod:`polykv.contract.model_data`): data key
    (the key a rule's model data declares) -> file. In a plan file the path is relative to the file's folder; a
    loaded plan holds it resolved, and :meth:`save` writes it relative to the new file's folder."""

    def group_of(self, layer: int) -> AllocationGroup | None:
        """The allocation group ``layer`` belongs to, or None."""
        for g in self.allocation:
            if layer in g.layers:
                return g
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerPlan:
        return self.layers[layer]

    @property
    def keeps_everything(self) -> bool:
        return all(lp.keeps_everything for lp in self.layers)

    def with_layer(self, layer: int, **changes: Any) -> "Plan":
        """A copy with ``changes`` applied to one layer."""
        layers = list(self.layers)
        layers[layer] = attrs.evolve(layers[layer], **changes)
        return attrs.evolve(self, layers=tuple(layers))

    @property
    def low_rank(self) -> bool:
        """Whether some layer stores projected (low-rank) codes."""
        return any(lp.low_rank for lp in self.layers)

    @property
    def written_schema_version(self) -> int:
        """The version a plan file of this plan carries: 2 when some layer shares or stores low-rank codes, else 1."""
        if self.low_rank or any(lp.share is not None for lp in self.layers):
            return SHARE_SCHEMA_VERSION
        return SCHEMA_VERSION

    @property
    def shares(self) -> bool:
        """Whether some layer names ``share`` or ``share_params`` (the pairs' checks run only then)."""
        return any(lp.share is not None or lp.share_params for lp in self.layers)

    def share_pairs(self) -> list[tuple[int, int]]:
        """(lower, upper) of every shared layer pair, by upper layer."""
        return [(lp.share, lp.layer) for lp in self.layers if lp.share is not None]

    def rules_used(self) -> set[str]:
        return {op.rule for lp in self.layers for op in (lp.prefill, lp.decode)}

    def axes_used(self) -> tuple[str, ...]:
        """The axes of the KV tensor this plan compresses, of ``tokens`` (some op evicts), ``bits`` (some layer is
        quantized), ``rank`` (some layer stores low-rank codes) and ``layers`` (some pair is shared)."""
        used = {"tokens": any(not op.keeps_everything for lp in self.layers for op in (lp.prefill, lp.decode)),
                "bits": any(lp.quantized for lp in self.layers), "rank": self.low_rank,
                "layers": bool(self.share_pairs())}
        return tuple(axis for axis, on in used.items() if on)

    # -- files -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The plan file's text (:func:`polykv.plan.writing.dumps`)."""
        return dumps(self)

    def save(self, path: str) -> None:
        """Write the plan atomically (temp file + rename): an existing file is never half-written."""
        save(self, path)


def _model_info(geometry, name: str = "") -> ModelInfo:
    return ModelInfo(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
                     head_dim=geometry.head_dim, name=name or geometry.model_type,
                     fingerprint=geometry.fingerprint)


def _as_op(op: OpSpec | str | None, capacity: int | None, ratio: float | None,
           params: Mapping[str, Any] | None) -> OpSpec:
    if isinstance(op, OpSpec):
        return op
    if op is None or op == FULL_RULE:
        return FULL_OP
    return OpSpec(rule=op, capacity=capacity, capacity_ratio=ratio, params=dict(params or {}))


def uniform_plan(geometry, *, prefill: OpSpec | str | None = None, decode: OpSpec | str | None = None,
                 capacity: int | None = None, capacity_ratio: float | None = None,
                 params: Mapping[str, Any] | None = None, k_bits: int = 16, v_bits: int = 16,
                 quantizer: str = DEFAULT_QUANTIZER, quantizer_params: Mapping[str, Any] | None = None,
                 decode_slack: int = 128, provenance: Provenance | None = None) -> Plan:
    """The same ops and bits on every layer.

    >>> uniform_plan(geo, prefill="snapkv", decode="tova", capacity=256, k_bits=8, v_bits=4)  # doctest: +SKIP
    """
    pre = _as_op(prefill, capacity, capacity_ratio, params)
    dec = _as_op(decode, capacity, capacity_ratio, params)
    layers = [LayerPlan(layer=i, prefill=pre, decode=dec, k_bits=k_bits, v_bits=v_bits,
                        quantizer=quantizer, quantizer_params=dict(quantizer_params or {}))
              for i in range(geometry.num_layers)]
    return Plan(layers=layers, model=_model_info(geometry), trigger=TriggerSettings(decode_slack=decode_slack),
                provenance=provenance or Provenance())


def full_plan(geometry) -> Plan:
    """Keep everything at 16 bits on every layer: must reproduce vanilla generation."""
    return uniform_plan(geometry)


def per_layer_plan(geometry, layers: Sequence[Mapping[str, Any] | LayerPlan], *, decode_slack: int = 128,
                   provenance: Provenance | None = None) -> Plan:
    """A plan from one entry per layer: LayerPlan objects or dicts of LayerPlan fields (``layer`` implied).

    >>> per_layer_plan(geo, [{"prefill": OpSpec(rule="tova", capacity=512)}] * geo.num_layers)  # doctest: +SKIP
    """
    if len(layers) != geometry.num_layers:
        raise PlanError(f"got {len(layers)} layer entries for a {geometry.num_layers}-layer model",
                        field="layers", hint="give exactly one entry per layer")
    out = []
    for i, entry in enumerate(layers):
        out.append(attrs.evolve(entry, layer=i) if isinstance(entry, LayerPlan)
                   else LayerPlan(layer=i, **dict(entry)))
    return Plan(layers=out, model=_model_info(geometry), trigger=TriggerSettings(decode_slack=decode_slack),
                provenance=provenance or Provenance())


def layer_ops(layers: Iterable[LayerPlan]) -> list[tuple[int, str, OpSpec]]:
    """Flatten to (layer, phase, op) triples."""
    return [(lp.layer, ph, getattr(lp, ph)) for lp in layers for ph in PHASES]
