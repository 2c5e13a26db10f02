"""The bytes model of a plan: nominal bytes (MoE-nD), exact resident bytes, metadata, ratios.

Two numbers per layer, for a context of ``T`` tokens:

* **nominal** bytes, MoE-nD's formula (arXiv 2604.17695):
  ``m_l = keep_l * T * Hkv * d * (k_bits_l + v_bits_l) / 8`` with ``keep_l * T = min(capacity_l, T)``
  whole tokens (a ratio capacity resolves with :meth:`polykv.OpSpec.resolve_capacity`). Scales,
  minima and full-precision residuals are not counted; this is what solvers budget against.
* **resident** bytes: exactly what the runtime's stores hold, via each quantizer's
  ``predict_reserved_bytes`` (16-bit streams: their preallocated buffers, ``C * Hkv * d * dtype_bytes``
  per batch row for the ``C`` token rows :mod:`polykv.reserve` reserves). Metadata the runtime keeps
  beside the stores is reported separately.

Which op bounds storage (``phase=``):

* ``"prefill"``: right after prefill, the layer holds ``min(prefill capacity, T)`` tokens. Resident
  bytes are exact for this phase: the runtime selects on the full-precision prompt and appends only
  the survivors, so the quantizer stores see no eviction.
* ``"decode"``: an upper bound on what the stores hold after any decode forward. A decode op
  that evicts fires when storage exceeds ``capacity + decode_slack`` and cuts back to ``capacity``,
  so a layer holds at most ``min(capacity + slack, prefill kept + new_tokens)`` tokens; eviction
  gathers survivors out of quantized groups, so the bytes are the quantizer's ``bound_bytes`` (the
  worst store layout of that many tokens after any appends and gathers: KIVI keys keep one scale
  and minimum row per surviving group and int32 group ids, KIVI keys and values keep up to a full
  residual block in the compute dtype). With a ``full`` decode op nothing is evicted: the layer
  holds ``prefill kept + k`` tokens after k generated tokens (``k <= new_tokens``), appended
  without eviction, and the bytes are the largest ``predict_bytes`` over that range (exact states).
  ``new_tokens=None`` bounds an unlimited generation for absolute decode capacities; a ratio
  capacity grows with the tokens seen and a ``full`` decode op with every token, so for those the
  bound holds for ``new_tokens`` generated tokens (None counts as 0: the start of decoding).

Window-bounded layers (sliding-window or chunked attention, see
:meth:`polykv.geometry.ModelGeometry.token_bound`) never hold more than their bound ``window - 1``,
whatever the plan says: kept tokens are ``min(plan's kept, bound)``, and their ``full_bytes`` (the
uncompressed baseline) is what vanilla transformers holds there, ``min(T, bound)`` tokens. The bound
is known when the geometry is a :class:`~polykv.geometry.ModelGeometry`; a plan's own ``model``
record carries no layer types, so pass the geometry for models with such layers.

Metadata right after prefill (the runtime keeps only the decode rule's state): positions int64
``[B, Hkv, C]`` (the reserved rows); then the decode rule's state (:meth:`RetentionRule.new_state`), predicted by
:meth:`RuleState.predict_bytes` and reported under its ``metadata_name``: ``accumulated``
(H2O's float32 ``[B, Hkv, kept]``), ``query_window`` (``[B, H, w, d]`` in the compute dtype plus
int64 positions ``[w]``, ``w = min(window, T)``), ``rule_state`` (any other state). The window
needs the number of query heads: from the geometry (a :class:`polykv.geometry.ModelGeometry`) or
``num_heads=``; without it the window is reported as not counted.

Ragged layers (a head-wise rule keeps a different number of tokens per KV head) hold, per head,
exactly that head's tokens: given the per-head counts the runtime reports (``head_counts=``, from
``cache.head_counts()``), the prediction is exact per head; without them it assumes the layer's
budget spread evenly. Layers of an allocation group get their budget at run time: given the
allocations (``allocations=``, from ``session.allocations()``) the prediction is exact; without
them each such row reports the allocator's bound (:meth:`Allocator.bound`) and is marked ``bound``.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from polykv.errors import PlanError
from polykv.plan import PASSTHROUGH_BITS, LayerPlan, OpSpec
from polykv.reserve import grown_capacity, layer_hold, reserve_tokens, reserved_stream_bytes

MEMORY_PHASES = ("prefill", "decode")


def _geometry(plan: Any, geometry: Any) -> Any:
    geo = geometry if geometry is not None else getattr(plan, "model", None)
    if geo is None:
        raise PlanError("no model geometry: the plan has no 'model' record and none was given", field="model",
                        hint="pass a geometry (polykv.geometry.geometry_from_config(config)) or a plan with a model")
    n = len(plan.layers)
    if int(geo.num_layers) != n:
        raise PlanError(f"the plan has {n} layers but the model geometry has {geo.num_layers}", field="layers",
                        hint="use a plan made for this model")
    return geo


def _check(context_tokens: int, phase: str) -> None:
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive integer, got {context_tokens!r}")
    if phase not in MEMORY_PHASES:
        raise ValueError(f"phase must be one of {MEMORY_PHASES}, got {phase!r}")


def _kept(op: OpSpec, context_tokens: int) -> int:
    cap = op.resolve_capacity(context_tokens)
    return context_tokens if cap is None else min(cap, context_tokens)


def kept_tokens(layer: LayerPlan, context_tokens: int, phase: str = "prefill", *, bound: int | None = None) -> int:
    """Tokens a layer holds for a ``context_tokens`` context in ``phase`` (see the module docstring).

    ``bound``: the layer's own token bound (a window-bounded layer), or None.
    """
    _check(context_tokens, phase)
    kept = _kept(layer.prefill, context_tokens)
    if phase == "decode" and not layer.decode.keeps_everything:
        kept = _kept(layer.decode, context_tokens)
    return kept if bound is None else min(kept, bound)


def layer_bounds(geometry: Any, num_layers: int) -> list[int | None]:
    """Per layer the token bound of a window-bounded layer, None elsewhere (all None without layer types)."""
    bound = getattr(geometry, "token_bound", None)
    if not callable(bound) or not getattr(geometry, "layer_types", None):
        return [None] * num_layers
    return [bound(i) for i in range(num_layers)]


def nominal_bytes(plan: Any, geometry: Any, context_tokens: int, *, phase: str = "prefill") -> list[int]:
    """MoE-nD nominal bytes per layer: ``kept * Hkv * d * (k_bits + v_bits) / 8`` (rounded up to a byte).

    ``geometry`` needs ``num_layers``, ``num_kv_heads``, ``head_dim``; None uses ``plan.model``.
    """
    geo = _geometry(plan, geometry)
    slot = int(geo.num_kv_heads) * int(geo.head_dim)
    bounds = layer_bounds(geo, len(plan.layers))
    return [-(-kept_tokens(lp, context_tokens, phase, bound=b) * slot * (lp.k_bits + lp.v_bits) // 8)
            for lp, b in zip(plan.layers, bounds)]


@attrs.define(frozen=True, kw_only=True)
class MemoryRow:
    """Bytes of one layer."""

    layer: int
    prefill: str
    """The prefill op (``rule@capacity``)."""
    decode: str
    """The decode op."""
    k_bits: int
    v_bits: int
    window_bound: int | None
    """The layer's own token bound (a sliding-window or chunked layer), or None."""
    kept_tokens: int
    """Tokens held in the reported phase."""
    nominal_bytes: int
    """MoE-nD nominal bytes."""
    key_bytes: int
    """Resident bytes of the key store (codes, scales, minima, residual)."""
    value_bytes: int
    """Resident bytes of the value store."""
    metadata: dict[str, int | None]
    """Bytes beside the stores: ``positions``, ``accumulated``, ``query_window`` (None = not counted)."""
    full_bytes: int
    """Bytes of this layer's uncompressed K+V cache holding the whole context (batch and dtype as given);
    for a window-bounded layer, ``min(T, bound)`` tokens (what vanilla transformers holds there)."""
    full_nominal_bytes: int
    """Nominal bytes of that uncompressed cache at 16-bit K and V: ``tokens * Hkv * d * 4``."""
    bound: bool = False
    """True when an allocator decides this layer's budget at run time and the row reports its bound."""

    @property
    def resident_bytes(self) -> int:
        return self.key_bytes + self.value_bytes

    @property
    def metadata_bytes(self) -> int:
        """Sum of the counted metadata."""
        return sum(v for v in self.metadata.values() if v is not None)


def decode_held_tokens(layer: LayerPlan, context_tokens: int, *, decode_slack: int,
                       new_tokens: int | None = None, after_prefill: int | None = None) -> tuple[int, int]:
    """(fewest, most) tokens per KV head a layer's stores hold after a decode forward (see the module
    docstring); ``after_prefill`` overrides the prefill op's count (an allocator's budget)."""
    _check(context_tokens, "decode")
    n = int(new_tokens or 0)
    if after_prefill is None:
        after_prefill = _kept(layer.prefill, context_tokens)
    if layer.decode.keeps_everything:  # after k >= 1 decode forwards of one token each
        return after_prefill + min(n, 1), after_prefill + n
    cap = layer.decode.resolve_capacity(context_tokens + n)
    most = cap + int(decode_slack)
    if new_tokens is not None:
        most = min(most, after_prefill + n)
    return min(cap, after_prefill), max(most, min(cap, after_prefill))


def stream_bound_bytes(quantizer: Any, stream: str, bits: int, *, held: tuple[int, int], evicts: bool,
                       batch: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> list[int]:
    """Bytes one stream's store holds at each token count of ``held`` = (fewest, most), or one bound.

    With eviction: ``[bound]``, the quantizer's ``bound_bytes`` at the most tokens (the worst layout after
    appends and gathers); a quantizer without one is assumed to hold ``predict_bytes`` of its token
    count (a layout that depends on the count only), maximised over the range. Without eviction every
    state is a fresh store after k appends: ``predict_bytes(k)`` for every k in the range.
    """
    shape = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    lo, hi = held
    if quantizer is None:  # 16 bits: passthrough, linear in the token count
        counts = [hi] if evicts else range(lo, hi + 1)
        return [batch * kv_heads * k * head_dim * dtype_bytes for k in counts]
    bound = getattr(quantizer, "bound_bytes", None)
    if evicts and bound is not None:
        return [int(bound(stream, bits, tokens=hi, **shape))]
    per_count = [int(quantizer.predict_bytes(stream, bits, tokens=k, **shape)) for k in range(lo, hi + 1)]
    return [max(per_count)] if evicts else per_count


def predict_resident(plan: Any, geometry: Any, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                     registry: Any = None, phase: str = "prefill", num_heads: int | None = None,
                     decode_slack: int | None = None, new_tokens: int | None = None,
                     head_counts: Any = None, allocations: Any = None) -> list[MemoryRow]:
    """Per-layer bytes the runtime holds for a ``context_tokens`` prompt: exact right after prefill
    (``phase="prefill"``), an upper bound over decoding (``phase="decode"``).

    Parameters
    ----------
    plan : Plan
        Anything with ``.layers`` of :class:`polykv.LayerPlan`.
    geometry : object or None
        ``num_layers``, ``num_kv_heads``, ``head_dim`` (and ``num_heads`` for query windows); None
        uses ``plan.model``.
    context_tokens : int
        Prompt length T.
    batch : int
        Batch rows B.
    dtype_bytes : int
        Element size of the compute dtype (2 for bf16/fp16, 4 for float32).
    registry : polykv.registry.Registry, optional
        Where quantizers and rules are looked up (default: the process-wide registry).
    phase : str
        ``"prefill"`` or ``"decode"`` (see the module docstring).
    num_heads : int, optional
        Query heads H, when the geometry does not carry ``num_heads``.
    decode_slack : int, optional
        Decode phase: tokens past capacity before eviction fires (default: the plan's
        ``trigger.decode_slack``, else 128).
    new_tokens : int, optional
        Decode phase: tokens generated after the context (see the module docstring).
    head_counts : sequence, optional
        Per layer, tokens stored per batch row and KV head (``cache.head_counts()``): exact bytes of
        ragged layers.
    allocations : mapping, optional
        ``session.allocations()``: the budgets an allocator gave; without them allocated layers
        report the allocator's bound.
    """
    from polykv.registry import get_registry

    _check(context_tokens, phase)
    geo = _geometry(plan, geometry)
    registry = registry if registry is not None else get_registry()
    heads = num_heads if num_heads is not None else getattr(geo, "num_heads", None)
    Hkv, d = int(geo.num_kv_heads), int(geo.head_dim)
    nominal = nominal_bytes(plan, geo, context_tokens, phase=phase)
    bounds = _allocation_bounds(plan, registry, context_tokens, allocations or {})
    rows = []
    if decode_slack is None:
        decode_slack = int(getattr(getattr(plan, "trigger", None), "decode_slack", 128))
    for lp, nom, wbound in zip(plan.layers, nominal, layer_bounds(geo, len(plan.layers))):
        kept = kept_tokens(lp, context_tokens, phase, bound=wbound)
        baseline = context_tokens if wbound is None else min(context_tokens, wbound)
        after_prefill = None
        bound = lp.layer in bounds
        if bound or (allocations and lp.layer in allocations):
            kept = bounds.get(lp.layer) or _allocated(allocations[lp.layer], context_tokens)
            nom = -(-kept * Hkv * d * (lp.k_bits + lp.v_bits) // 8)
            after_prefill = kept
        per_head = _per_head(head_counts, lp.layer, batch, Hkv) if phase == "prefill" else None
        evicts = not lp.decode.keeps_everything
        cap = (kept if after_prefill is not None else lp.decode.resolve_capacity(context_tokens)) if evicts else None
        if phase == "decode":
            held = decode_held_tokens(lp, context_tokens, decode_slack=decode_slack, new_tokens=new_tokens,
                                      after_prefill=after_prefill)
            if wbound is not None:  # a windowed layer is trimmed to its bound after every decode forward
                held = (min(held[0], wbound), min(held[1], wbound))
            most_rows = _decode_rows(lp, context_tokens, after_prefill, decode_slack, wbound, new_tokens)
            kept = held[1]
            stream_bytes = _decode_stream_bytes(lp, registry, held, batch, Hkv, d, dtype_bytes, most_rows)
            reserved = [most_rows]
        elif per_head is None:
            reserved = [reserve_tokens(kept, layer_hold(capacity=cap, decode_slack=decode_slack, bound=wbound))]
            stream_bytes = [_stream_bytes(lp, registry, stream, bits, batch, Hkv, d, kept, dtype_bytes, reserved[0])
                            for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))]
        else:
            reserved = [reserve_tokens(n, layer_hold(capacity=n if evicts else None, decode_slack=decode_slack,
                                                     bound=wbound)) for n in per_head]
            stream_bytes = [sum(_stream_bytes(lp, registry, stream, bits, 1, 1, d, n, dtype_bytes, r)
                                for n, r in zip(per_head, reserved))
                            for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))]
        width = kept if per_head is None else max(per_head)
        meta = _metadata(lp, registry, batch, Hkv, d, heads, width, context_tokens, dtype_bytes)
        meta["positions"] = 8 * (sum(reserved) if per_head is not None else batch * Hkv * reserved[0])
        rows.append(MemoryRow(
            layer=lp.layer, prefill=lp.prefill.describe(), decode=lp.decode.describe(), k_bits=lp.k_bits,
            v_bits=lp.v_bits, window_bound=wbound, kept_tokens=kept, nominal_bytes=nom, key_bytes=stream_bytes[0],
            value_bytes=stream_bytes[1], metadata=meta,
            full_bytes=2 * batch * Hkv * baseline * d * dtype_bytes,
            full_nominal_bytes=4 * Hkv * baseline * d, bound=bound))
    return rows


def _decode_rows(lp: LayerPlan, context_tokens: int, after_prefill: int | None, decode_slack: int,
                 wbound: int | None, new_tokens: int | None) -> int:
    """Most token rows a layer's 16-bit buffers and positions reserve after any one-token decode forward
    (:mod:`polykv.reserve`): ``hold + 1`` for a layer cut back to ``hold`` tokens (rounded up to the
    growth block when a ratio capacity moves ``hold``), else the grown buffer of everything kept."""
    n = int(new_tokens or 0)
    evicts = not lp.decode.keeps_everything
    cap = None
    if evicts:
        cap = after_prefill if after_prefill is not None else lp.decode.resolve_capacity(context_tokens + n)
    hold = layer_hold(capacity=cap, decode_slack=decode_slack, bound=wbound)
    if hold is None:
        start = after_prefill if after_prefill is not None else _kept(lp.prefill, context_tokens)
        return grown_capacity(start + max(n, 1))
    moving = evicts and after_prefill is None and lp.decode.capacity is None
    return grown_capacity(hold + 1) if moving else hold + 1


def _decode_stream_bytes(lp: LayerPlan, registry: Any, held: tuple[int, int], batch: int, Hkv: int, d: int,
                         dtype_bytes: int, rows: int) -> list[int]:
    """[key, value] bytes bounding a layer's stores over decoding (see :func:`stream_bound_bytes`); a 16-bit
    stream holds its buffer of ``rows`` token rows."""
    evicts = not lp.decode.keeps_everything
    per_stream = []
    for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits)):
        try:
            quantizer = None if bits == PASSTHROUGH_BITS else registry.quantizer(lp.quantizer)(**lp.quantizer_params)
            per_stream.append(stream_bound_bytes(quantizer, stream, bits, held=held, evicts=evicts, batch=batch,
                                                 kv_heads=Hkv, head_dim=d, dtype_bytes=dtype_bytes))
        except (ValueError, KeyError) as exc:
            raise PlanError(str(exc), layer=lp.layer, field="quantizer_params",
                            hint="fix the layer's quantizer, bits or parameters") from None
    # the largest K+V total over the token counts (one count when evicting: both bounds at the most)
    at = max(range(len(per_stream[0])), key=lambda i: per_stream[0][i] + per_stream[1][i])
    return [batch * Hkv * rows * d * dtype_bytes if bits == PASSTHROUGH_BITS else per_stream[i][at]
            for i, bits in enumerate((lp.k_bits, lp.v_bits))]


def _stream_bytes(lp: LayerPlan, registry: Any, stream: str, bits: int, batch: int, Hkv: int, d: int, kept: int,
                  dtype_bytes: int, reserved: int) -> int:
    shape = dict(batch=batch, kv_heads=Hkv, head_dim=d, tokens=kept, reserved=reserved, dtype_bytes=dtype_bytes)
    if bits == PASSTHROUGH_BITS:
        return reserved_stream_bytes(None, stream, bits, **shape)
    try:
        quantizer = registry.quantizer(lp.quantizer)(**lp.quantizer_params)
        return reserved_stream_bytes(quantizer, stream, bits, **shape)
    except (ValueError, KeyError) as exc:
        raise PlanError(str(exc), layer=lp.layer, field="quantizer_params",
                        hint="fix the layer's quantizer, bits or parameters") from None


def _per_head(head_counts: Any, layer: int, batch: int, Hkv: int) -> list[int] | None:
    """The layer's per-(row, head) counts, flattened, when given and not all equal (ragged)."""
    if head_counts is None:
        return None
    flat = [int(n) for row in head_counts[layer] for n in row]
    if len(flat) != batch * Hkv:
        raise ValueError(f"head_counts[{layer}] has {len(flat)} entries, expected batch x kv_heads = {batch * Hkv}")
    return None if len(set(flat)) == 1 else flat


def _allocated(entry: Any, context_tokens: int) -> int:
    budget = entry["budget"]
    return min(max(budget) if isinstance(budget, list) else int(budget), context_tokens)


def _allocation_bounds(plan: Any, registry: Any, context_tokens: int, allocations: Any) -> dict[int, int]:
    """Allocator bound per allocated layer that ``allocations`` does not cover."""
    out: dict[int, int] = {}
    for group in getattr(plan, "allocation", ()):
        caps = [_kept(plan.layers[i].prefill, context_tokens) for i in group.layers]
        bounds = registry.allocator(group.allocator)(**group.params).bound(caps, context_tokens)
        for layer, b in zip(group.layers, bounds):
            if layer not in allocations:
                out[layer] = min(int(b), context_tokens)
    return out


def _metadata(lp: LayerPlan, registry: Any, batch: int, Hkv: int, d: int, heads: int | None, kept: int,
              context_tokens: int, dtype_bytes: int) -> dict[str, int | None]:
    """positions and the decode rule's state bytes kept beside the stores, by ``metadata_name``."""
    out: dict[str, int | None] = {"positions": 8 * batch * Hkv * kept, "accumulated": 0, "query_window": 0}
    if lp.decode.keeps_everything:
        return out
    state = registry.operator(lp.decode.rule)(**lp.decode.params).new_state()
    for leaf in ([] if state is None else state.leaves()):
        got = leaf.predict_bytes(batch=batch, kv_heads=Hkv, heads=heads, head_dim=d, tokens=kept,
                                 context_tokens=context_tokens, dtype_bytes=dtype_bytes)
        have = out.get(leaf.metadata_name, 0)
        out[leaf.metadata_name] = None if got is None or have is None else have + int(got)
    return out


@attrs.define(frozen=True, kw_only=True)
class MemoryReport:
    """Per-layer and total bytes of a plan at one context length, batch and dtype."""

    rows: tuple[MemoryRow, ...] = attrs.field(converter=tuple)
    context_tokens: int
    batch: int
    dtype_bytes: int
    phase: str
    group_bounds: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=tuple)
    """Per allocation group: (``allocator[first..last]``, most tokens per KV head over all its layers)."""

    @property
    def nominal_total(self) -> int:
        return sum(r.nominal_bytes for r in self.rows)

    @property
    def resident_total(self) -> int:
        """Key + value store bytes over all layers (metadata excluded)."""
        return sum(r.resident_bytes for r in self.rows)

    @property
    def metadata_total(self) -> int:
        return sum(r.metadata_bytes for r in self.rows)

    @property
    def metadata_complete(self) -> bool:
        """False when some metadata could not be counted (query windows without ``num_heads``)."""
        return all(v is not None for r in self.rows for v in r.metadata.values())

    @property
    def full_total(self) -> int:
        """Bytes of an uncompressed K+V cache (compute dtype; 16-bit by default) holding the whole context."""
        return sum(r.full_bytes for r in self.rows)

    @property
    def ratio(self) -> float:
        """Compression ratio: full cache bytes / resident K+V bytes."""
        return self.full_total / self.resident_total

    @property
    def ratio_with_metadata(self) -> float:
        """Full cache bytes / (resident K+V + counted metadata)."""
        return self.full_total / (self.resident_total + self.metadata_total)

    @property
    def nominal_ratio(self) -> float:
        """Nominal compression: 16-bit nominal bytes of the whole context / the plan's nominal bytes."""
        return sum(r.full_nominal_bytes for r in self.rows) / self.nominal_total

    def format_table(self) -> str:
        """A plain-text table: one line per layer, then totals and ratios."""
        head = ("layer", "prefill", "decode", "K", "V", "kept", "nominal B", "resident B", "metadata B")
        body = [(str(r.layer) + ("w" if r.window_bound is not None else ""), r.prefill, r.decode, str(r.k_bits),
                 str(r.v_bits), ("<=" if r.bound else "") + f"{r.kept_tokens:,}",
                 f"{r.nominal_bytes:,}", f"{r.resident_bytes:,}",
                 f"{r.metadata_bytes:,}" + ("" if None not in r.metadata.values() else "+?"))
                for r in self.rows]
        total = ("total", "", "", "", "", "", f"{self.nominal_total:,}", f"{self.resident_total:,}",
                 f"{self.metadata_total:,}" + ("" if self.metadata_complete else "+?"))
        lines = _align([head] + body + [total], right_from=3)
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        lines += [
            f"context {self.context_tokens:,} tokens, batch {self.batch}, {self.dtype_bytes}-byte compute dtype, "
            f"phase {self.phase} ({'right after prefill' if self.phase == 'prefill' else 'decode bound'})",
            f"full cache (whole context, compute dtype) {self.full_total:,} B; compression {self.ratio:.2f}x resident "
            f"({self.ratio_with_metadata:.2f}x with metadata), {self.nominal_ratio:.2f}x nominal",
        ]
        bounded = [r for r in self.rows if r.window_bound is not None]
        if bounded:
            lines.append(f"w = window-bounded layer ({len(bounded)} of {len(self.rows)}): keeps at most its model's "
                         f"window ({bounded[0].window_bound:,} tokens) whatever the plan says")
        if not self.metadata_complete:
            lines.append("+? query windows not counted: the geometry has no num_heads (pass num_heads=)")
        if any(r.bound for r in self.rows):
            lines.append("<= an allocator decides these layers' budgets after prefill: each row is that layer's own "
                         "bound, so the totals over-state the group (session.allocations() reports what was allocated)")
        for name, tokens in self.group_bounds:
            lines.append(f"allocation group {name}: at most {tokens:,} tokens per KV head over all its layers")
        return "\n".join(lines)


def _align(rows: Sequence[Sequence[str]], right_from: int) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def memory_report(plan: Any, geometry: Any = None, context_tokens: int = 4096, *, batch: int = 1,
                  dtype_bytes: int = 2, registry: Any = None, phase: str = "prefill",
                  num_heads: int | None = None, decode_slack: int | None = None,
                  new_tokens: int | None = None) -> MemoryReport:
    """Nominal, resident and metadata bytes of ``plan`` per layer and in total (see :func:`predict_resident`).

    >>> print(memory_report(plan, geometry, 16000).format_table())  # doctest: +SKIP
    """
    from polykv.registry import get_registry

    rows = predict_resident(plan, geometry, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                            registry=registry, phase=phase, num_heads=num_heads, decode_slack=decode_slack,
                            new_tokens=new_tokens)
    registry = registry if registry is not None else get_registry()
    groups = []
    for g in getattr(plan, "allocation", ()):
        caps = [_kept(plan.layers[i].prefill, context_tokens) for i in g.layers]
        groups.append((g.describe(), int(registry.allocator(g.allocator)(**g.params).group_bound(caps, context_tokens))))
    return MemoryReport(rows=rows, context_tokens=context_tokens, batch=batch, dtype_bytes=dtype_bytes, phase=phase,
                        group_bounds=groups)


# -- what a budget counts ----------------------------------------------------------------------------
BASES = ("resident", "nominal")
"""Budget bases: ``resident`` = bytes the runtime holds (stores + metadata, the peak over phases);
``nominal`` = MoE-nD's formula (codes only, at the decode bound)."""

STORAGE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Element size of each cache storage dtype a budget may name."""


def full_cache_bytes_16bit(geometry: Any, context_tokens: int, batch: int = 1) -> int:
    """Bytes of the uncompressed 16-bit K+V cache vanilla transformers holds after ``context_tokens`` (the
    ratio basis): every full-attention layer holds them all, a window-bounded layer at most its window."""
    if hasattr(geometry, "full_cache_bytes"):
        return int(geometry.full_cache_bytes(int(context_tokens), batch=int(batch), dtype_bytes=2))
    return 4 * int(geometry.num_layers) * int(geometry.num_kv_heads) * int(geometry.head_dim) \
        * int(context_tokens) * int(batch)


def held_bytes_per_layer(plan: Any, geometry: Any, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                         registry: Any = None, num_heads: int | None = None) -> list[int]:
    """Per layer, the most bytes the runtime holds for a ``context_tokens`` prompt: key + value stores
    plus metadata, the larger of the two phases (right after prefill, and the decode bound).

    A decode-only eviction rule holds the whole prompt right after prefill, so it does not lower this
    peak. Raises :class:`PlanError` when metadata cannot be counted (a query window without ``num_heads``).
    """
    phases = [predict_resident(plan, geometry, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                               registry=registry, phase=ph, num_heads=num_heads) for ph in MEMORY_PHASES]
    out = []
    for rows in zip(*phases):
        if any(None in r.metadata.values() for r in rows):
            raise PlanError("a decode rule keeps a query window, but the model's number of query heads is unknown",
                            layer=rows[0].layer, field="model.num_heads",
                            hint="give the geometry's num_heads (profiles record it when calibrated on a model)")
        out.append(max(r.resident_bytes + r.metadata_bytes for r in rows))
    return out


@attrs.define(frozen=True)
class _OneLayer:
    layers: tuple


@attrs.define(frozen=True)
class _OneLayerGeometry:
    num_kv_heads: int
    head_dim: int
    num_heads: int | None
    num_layers: int = 1


def layer_held_bytes(layer: LayerPlan, geometry: Any, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                     registry: Any = None) -> int:
    """:func:`held_bytes_per_layer` of one layer (``geometry`` needs ``num_kv_heads``, ``head_dim``,
    and ``num_heads`` when a decode rule keeps a query window)."""
    geo = _OneLayerGeometry(num_kv_heads=int(geometry.num_kv_heads), head_dim=int(geometry.head_dim),
                            num_heads=getattr(geometry, "num_heads", None))
    return held_bytes_per_layer(_OneLayer(layers=(attrs.evolve(layer, layer=0),)), geo, context_tokens, batch=batch,
                                dtype_bytes=dtype_bytes, registry=registry)[0]


def context_note(plan: Any, context_tokens: int, *, registry: Any = None) -> str | None:
    """One line when ``plan`` keeps absolute token capacities and runs on a context other than the one
    its budget was stated for (``plan.provenance.context_tokens``): the share of a 16-bit full cache it
    really holds there (bfloat16 storage, metadata included) beside the share at the budgeted length.
    None when capacities are ratios, the lengths agree, or the plan records no context or model.
    """
    budgeted = getattr(getattr(plan, "provenance", None), "context_tokens", None)
    geo = getattr(plan, "model", None)
    absolute = any(not op.keeps_everything and op.capacity is not None
                   for lp in plan.layers for op in (lp.prefill, lp.decode))
    if not absolute or not budgeted or geo is None or int(budgeted) == int(context_tokens):
        return None

    def ratio(T: int) -> float:
        rows = predict_resident(plan, geo, T, registry=registry)
        held = sum(r.resident_bytes + r.metadata_bytes for r in rows)
        return full_cache_bytes_16bit(geo, T) / held

    return (f"this plan keeps absolute token capacities budgeted for a {budgeted:,}-token context but runs on "
            f"{context_tokens:,} tokens: it holds {ratio(context_tokens):.2f}x less than a 16-bit full cache here "
            f"(with metadata), {ratio(int(budgeted)):.2f}x at {budgeted:,} tokens; solve with ratio capacities "
            f"to keep the compression at any length")
