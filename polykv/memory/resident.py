"""Resident bytes: exactly what the runtime's stores and metadata hold per layer, right after prefill or
bounded over decoding (see :mod:`polykv.memory` for the model)."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs

from polykv.errors import PlanError
from polykv.memory.tokens import (check_context, code_bits, decode_held_tokens, kept_tokens, layer_bounds, nominal_bytes,
                                  plan_geometry)
from polykv.plan import PASSTHROUGH_BITS, LayerPlan
from polykv.registry import get_registry
from polykv.storage.layer_share import DEFAULT_RETENTION_RATIO, retained_count, shared_pair_bytes
from polykv.storage.token_buffer import (cut_back_rows, grown_capacity, layer_hold, reserve_tokens,
                                    reserved_stream_bytes)


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
    k_rank: int | None = None
    """Channels of the layer's key codes (None: full width)."""
    v_rank: int | None = None
    """Channels of the layer's value codes (None: full width)."""

    @property
    def resident_bytes(self) -> int:
        return self.key_bytes + self.value_bytes

    @property
    def metadata_bytes(self) -> int:
        """Sum of the counted metadata."""
        return sum(v for v in self.metadata.values() if v is not None)



def stream_bound_bytes(quantizer: Any, stream: str, bits: int, *, held: tuple[int, int], evicts: bool,
                       batch: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                       reserved: int | None = None) -> list[int]:
    """Bytes one stream's store holds at each token count of ``held`` = (fewest, most), or one bound.

    ``reserved``: the tokens the runtime asks the store to reserve (:mod:`polykv.storage.token_buffer`): after each
    eviction (evicting layers), or once for the prompt (None: never). With eviction: ``[bound]``, the
    quantizer's ``bound_reserved_bytes`` (or ``bound_bytes`` at the most tokens, a store that does not
    preallocate): the worst layout after appends and gathers; a quantizer with neither is assumed to
    hold ``predict_bytes`` of its token count, maximised over the range. Without eviction every state
    is a fresh store after k appends: ``predict_reserved_bytes(k)`` (``predict_bytes`` when nothing
    was reserved) for every k in the range.
    """
    shape = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    lo, hi = held
    if quantizer is None:  # 16 bits: passthrough, linear in the token count
        counts = [hi] if evicts else range(lo, hi + 1)
        return [batch * kv_heads * k * head_dim * dtype_bytes for k in counts]
    if evicts:
        reserved_bound = getattr(quantizer, "bound_reserved_bytes", None)
        if reserved_bound is not None and reserved is not None:
            return [int(reserved_bound(stream, bits, tokens=hi, reserved=reserved, **shape))]
        bound = getattr(quantizer, "bound_bytes", None)
        if bound is not None:
            return [int(bound(stream, bits, tokens=hi, **shape))]
    if reserved is None:
        per_count = [int(quantizer.predict_bytes(stream, bits, tokens=k, **shape)) for k in range(lo, hi + 1)]
    else:
        per_count = [int(quantizer.predict_reserved_bytes(stream, bits, tokens=k, reserved=reserved, **shape))
                     for k in range(lo, hi + 1)]
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
        ``"prefill"`` or ``"decode"`` (see :mod:`polykv.memory`).
    num_heads : int, optional
        Query heads H, when the geometry does not carry ``num_heads``.
    decode_slack : int, optional
        Decode phase: tokens past capacity before eviction fires (default: the plan's
        ``trigger.decode_slack``, else 128).
    new_tokens : int, optional
        Decode phase: tokens generated after the context (see :mod:`polykv.memory`).
    head_counts : sequence, optional
        Per layer, tokens stored per batch row and KV head (``cache.head_counts()``): exact bytes of
        ragged layers.
    allocations : mapping, optional
        ``session.allocations()``: the budgets an allocator gave; without them allocated layers
        report the allocator's bound.
    """
    check_context(context_tokens, phase)
    geo = plan_geometry(plan, geometry)
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
            nom = -(-kept * Hkv * code_bits(lp, d) // 8)
            after_prefill = kept
        per_head = _per_head(head_counts, lp.layer, batch, Hkv) if phase == "prefill" else None
        evicts = not lp.decode.keeps_everything
        cap = (kept if after_prefill is not None else lp.decode.resolve_capacity(context_tokens)) if evicts else None
        if phase == "decode":
            held = decode_held_tokens(lp, context_tokens, decode_slack=decode_slack, new_tokens=new_tokens,
                                      after_prefill=after_prefill)
            if wbound is not None:  # a windowed layer is trimmed to its bound after every decode forward
                held = (min(held[0], wbound), min(held[1], wbound))
            most_rows, asked = _decode_rows(lp, context_tokens, after_prefill, decode_slack, wbound, new_tokens)
            kept = held[1]
            stream_bytes = _decode_stream_bytes(lp, registry, held, batch, Hkv, d, dtype_bytes, most_rows, asked)
            reserved = [most_rows]
        elif per_head is None:
            reserved = [reserve_tokens(kept, layer_hold(capacity=cap, decode_slack=decode_slack, bound=wbound),
                                       slack=decode_slack)]
            stream_bytes = [_stream_bytes(lp, registry, stream, bits, batch, Hkv, lp.rank_of(stream, d), kept,
                                          dtype_bytes, reserved[0])
                            for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))]
        else:
            reserved = [reserve_tokens(n, layer_hold(capacity=n if evicts else None, decode_slack=decode_slack,
                                                     bound=wbound), slack=decode_slack) for n in per_head]
            stream_bytes = [sum(_stream_bytes(lp, registry, stream, bits, 1, 1, lp.rank_of(stream, d), n,
                                              dtype_bytes, r)
                                for n, r in zip(per_head, reserved))
                            for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))]
        width = kept if per_head is None else max(per_head)
        # states hold what the rules read: a low-rank layer's queries and keys are key codes (k_rank wide)
        meta = _metadata(lp, registry, batch, Hkv, lp.rank_of("key", d), heads, width, context_tokens, dtype_bytes)
        meta["positions"] = 8 * (sum(reserved) if per_head is not None else batch * Hkv * reserved[0])
        rows.append(MemoryRow(
            layer=lp.layer, prefill=lp.prefill.describe(), decode=lp.decode.describe(), k_bits=lp.k_bits,
            v_bits=lp.v_bits, k_rank=lp.k_rank, v_rank=lp.v_rank, window_bound=wbound,
            kept_tokens=kept, nominal_bytes=nom, key_bytes=stream_bytes[0],
            value_bytes=stream_bytes[1], metadata=meta,
            full_bytes=2 * batch * Hkv * baseline * d * dtype_bytes,
            full_nominal_bytes=4 * Hkv * baseline * d, bound=bound))
    return _shared(plan, rows, context_tokens, batch=batch, Hkv=Hkv, d=d, dtype_bytes=dtype_bytes, phase=phase,
                   new_tokens=new_tokens)


def _shared(plan: Any, rows: list[MemoryRow], context_tokens: int, *, batch: int, Hkv: int, d: int,
            dtype_bytes: int, phase: str, new_tokens: int | None) -> list[MemoryRow]:
    """The rows of shared layer pairs (``LayerPlan.share``, :mod:`polykv.storage.layer_share`): per stream, the
    lower layer holds the shared directions of the merged tokens, and each layer its magnitudes, its retained
    tokens (``ceil(retention_ratio * T)`` per head, known in advance) and, in decode, its own unmerged decode
    tokens (a buffer grown in blocks from empty); the upper layer's metadata counts the retained indices
    (``share_index``, int64, key and value streams)."""
    out = list(rows)
    decode_rows = grown_capacity(int(new_tokens or 0), 0) if phase == "decode" else 0
    for lp in plan.layers:
        share = getattr(lp, "share", None)
        if share is None:
            continue
        ratio = float(lp.share_params.get("retention_ratio", DEFAULT_RETENTION_RATIO))
        for side, layer in enumerate((share, lp.layer)):
            row = out[layer]
            stream = shared_pair_bytes(batch=batch, kv_heads=Hkv, head_dim=d, tokens=context_tokens,
                                       retention_ratio=ratio, dtype_bytes=dtype_bytes, side=side)
            stream += batch * Hkv * decode_rows * d * dtype_bytes
            meta = dict(row.metadata)
            if side == 1:
                meta["share_index"] = 2 * 8 * batch * Hkv * retained_count(context_tokens, ratio)
            out[layer] = attrs.evolve(row, key_bytes=stream, value_bytes=stream, metadata=meta)
    return out


def _decode_rows(lp: LayerPlan, context_tokens: int, after_prefill: int | None, decode_slack: int,
                 wbound: int | None, new_tokens: int | None) -> tuple[int, int]:
    """(rows, reserved): the most token rows a layer's 16-bit buffers and positions hold after any one-token
    decode forward (:mod:`polykv.storage.token_buffer`), and the most tokens its stores were asked to reserve.

    A layer cut back to ``hold`` tokens reserves ``hold + 1`` rows (at the most tokens seen, for a ratio
    capacity) after each eviction; before its first eviction (a prompt shorter than ``hold``, ``new_tokens``
    known) it holds what :func:`polykv.storage.token_buffer.cut_back_rows` says. A layer that keeps everything
    reserved exactly what prefill kept and then grows (``new_tokens`` None or 0: the start of decoding,
    exactly that)."""
    n = int(new_tokens or 0)
    evicts = not lp.decode.keeps_everything
    cap = None
    if evicts:
        cap = after_prefill if after_prefill is not None else lp.decode.resolve_capacity(context_tokens + n)
    hold = layer_hold(capacity=cap, decode_slack=decode_slack, bound=wbound)
    if hold is None:  # exactly the prompt until the first decode token, then grown in blocks
        start = after_prefill if after_prefill is not None else lp.prefill.kept_tokens(context_tokens)
        return grown_capacity(start + n, start), start
    start = after_prefill if after_prefill is not None else lp.prefill.kept_tokens(context_tokens)
    fixed = cap is None or after_prefill is not None or lp.decode.capacity_ratio is None
    if new_tokens is not None and fixed and start + n <= hold:   # not cut back yet: the prompt and its slack
        rows = cut_back_rows(start, n, hold, slack=decode_slack)
        return rows, rows
    return hold + 1, hold + 1  # cut back at least once (a ratio capacity's hold moves with the tokens seen)


def _decode_stream_bytes(lp: LayerPlan, registry: Any, held: tuple[int, int], batch: int, Hkv: int, d: int,
                         dtype_bytes: int, rows: int, reserved: int) -> list[int]:
    """[key, value] bytes bounding a layer's stores over decoding (see :func:`stream_bound_bytes`); a 16-bit
    stream holds its buffer of ``rows`` token rows, a quantized one was asked to reserve ``reserved``."""
    evicts = not lp.decode.keeps_everything
    per_stream, widths = [], (lp.rank_of("key", d), lp.rank_of("value", d))
    for (stream, bits), width in zip((("key", lp.k_bits), ("value", lp.v_bits)), widths):
        with _quantizer_errors(lp):
            quantizer = None if bits == PASSTHROUGH_BITS else registry.quantizer(lp.quantizer)(**lp.quantizer_params)
            per_stream.append(stream_bound_bytes(quantizer, stream, bits, held=held, evicts=evicts, batch=batch,
                                                 kv_heads=Hkv, head_dim=width, dtype_bytes=dtype_bytes,
                                                 reserved=reserved))
    # the largest K+V total over the token counts (one count when evicting: both bounds at the most)
    at = max(range(len(per_stream[0])), key=lambda i: per_stream[0][i] + per_stream[1][i])
    return [batch * Hkv * rows * widths[i] * dtype_bytes if bits == PASSTHROUGH_BITS else per_stream[i][at]
            for i, bits in enumerate((lp.k_bits, lp.v_bits))]


def _stream_bytes(lp: LayerPlan, registry: Any, stream: str, bits: int, batch: int, Hkv: int, d: int, kept: int,
                  dtype_bytes: int, reserved: int) -> int:
    shape = dict(batch=batch, kv_heads=Hkv, head_dim=d, tokens=kept, reserved=reserved, dtype_bytes=dtype_bytes)
    if bits == PASSTHROUGH_BITS:
        return reserved_stream_bytes(None, stream, bits, **shape)
    with _quantizer_errors(lp):
        quantizer = registry.quantizer(lp.quantizer)(**lp.quantizer_params)
        return reserved_stream_bytes(quantizer, stream, bits, **shape)


@contextlib.contextmanager
def _quantizer_errors(lp: LayerPlan):
    """A quantizer that refuses the layer's bits or parameters is a PlanError naming the layer and field."""
    try:
        yield
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
        caps = [plan.layers[i].prefill.kept_tokens(context_tokens) for i in group.layers]
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
    state = registry.rule(lp.decode.rule)(**lp.decode.params).new_state()
    for leaf in ([] if state is None else state.leaves()):
        got = leaf.predict_bytes(batch=batch, kv_heads=Hkv, heads=heads, head_dim=d, tokens=kept,
                                 context_tokens=context_tokens, dtype_bytes=dtype_bytes)
        have = out.get(leaf.metadata_name, 0)
        out[leaf.metadata_name] = None if got is None or have is None else have + int(got)
    return out

