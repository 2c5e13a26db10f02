"""Checks on what plugins return, in one place: rules' scores and selections, stores' lengths, shapes
and bytes, allocators' budgets. The runtime calls them at each call of a plugin method, and
:mod:`polykv.testing` calls the same ones, so a broken plugin fails with the same one line either way:
a :class:`~polykv.errors.PluginContractError` naming the layer, the phase, the plugin and what was
expected vs what it got.

*Always on* (cheap: shapes, lengths and byte counts are plain ints, no device sync beyond the checks of
a selection the runtime always made): the shape of a rule's scores, a selection's indices (in range,
strictly ascending per head, no padding column, merge targets kept, merge weights finite), every
quantized store's ``len`` after each append, gather and write, the shape of everything a store dequantizes for
attention or a rule, resident bytes equal to the quantizer's prediction right after prefill, and an
allocator's budgets (shape, dtype, within its declared bound).

*Expensive* (they read values or dequantize whole stores), on when the environment variable
``POLYKV_CHECK=1`` is set or ``polykv.apply(..., check=True)``: scores free of NaN where they decide
(outside protected and padding columns), every store dequantized after each append, gather and write
(shape and dtype), and a write's :class:`~polykv.contract.stores.WriteCost` against its mask.
A 16-bit layer's stores are polykv's own buffers: their checks run only with the expensive ones.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from polykv.contract.rules import where
from polykv.contract.selection import Selection, as_selection
from polykv.contract.stores import UNQUANTIZED_BITS
from polykv.errors import PluginContractError
from polykv.storage.token_buffer import reserved_stream_bytes


# -- rules -----------------------------------------------------------------------------------------

def checked_selection(result, ctx, capacity: int, *, where: str) -> Selection:
    """``result`` of ``rule.select(ctx, capacity)`` as a checked :class:`Selection`.

    Rectangular selections on uniform storage must be [B, Hkv, capacity]; every kept entry is a real
    (non-padding) column, strictly ascending per head (so unique); ragged counts never exceed a head's
    tokens and sum, per batch row, to at most ``capacity * Hkv`` (the sum of the per-head budgets when
    an allocator gave them). Ragged selections are trimmed to the longest head. A merge's targets must
    be kept tokens and its weights (and ``target_scale``) finite.
    """
    if not isinstance(result, (torch.Tensor, Selection)):
        raise PluginContractError(f"{where} select() returned a {type(result).__name__}; expected a [B, Hkv, k] "
                                  f"int64 tensor or a polykv.contract.selection.Selection (fix the rule's select())")
    sel = as_selection(result)
    idx = sel.index
    B, Hkv, T = ctx.positions.shape
    fix = "(fix the rule's select())"
    if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, Hkv):
        raise PluginContractError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                  f"expected ({B}, {Hkv}, k) int64 {fix}")
    if not sel.ragged and ctx.valid is None and ctx.head_capacity is None and idx.shape[2] != capacity:
        raise PluginContractError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                  f"expected ({B}, {Hkv}, {capacity}) int64 {fix}")
    kept = None
    if sel.ragged:
        sel = _checked_counts(sel, ctx, capacity, where, fix)
        idx, kept = sel.index, sel.kept_mask()
    if idx.numel():
        inside = (idx >= 0) & (idx < T)
        steps = idx[..., 1:] > idx[..., :-1]
        if kept is not None:  # a ragged selection's padding columns are neither checked nor compared
            inside, steps = inside[kept], steps | ~kept[..., :-1]
        if not bool(inside.all()):
            raise PluginContractError(f"{where} returned indices outside [0, {T}) {fix}")
        if not bool(steps.all()):
            raise PluginContractError(f"{where} returned indices that are not strictly ascending within "
                                      f"[0, {T}) (a repeated or unsorted column) {fix}")
        if ctx.valid is not None:
            real = ctx.valid.gather(-1, idx.clamp(0, T - 1))
            if not bool((real if kept is None else real[kept]).all()):
                raise PluginContractError(f"{where} kept a padding column (ctx.valid is False there) {fix}")
    if sel.merge is not None:
        _check_merge(sel.merge, idx, sel.kept_mask() if kept is None else kept, B, Hkv, T, where, fix)
    return sel


def _checked_counts(sel: Selection, ctx, capacity: int, where: str, fix: str) -> Selection:
    """A ragged selection's per-head counts: none above a head's tokens, each batch row within the layer's budget;
    the selection trimmed to its longest head."""
    idx = sel.index
    B, Hkv = idx.shape[:2]
    counts = sel.head_counts().to(idx.device)
    lengths = ctx.head_lengths().to(idx.device)
    if tuple(counts.shape) != (B, Hkv) or bool((counts < 0).any()) or bool((counts > lengths).any()):
        raise PluginContractError(f"{where} returned per-head counts {counts.tolist()} for heads storing "
                                  f"{lengths.tolist()} tokens {fix}")
    budget = capacity * Hkv if ctx.head_capacity is None else ctx.head_capacity.sum(-1)
    if bool((counts.sum(-1) > torch.as_tensor(budget, device=idx.device)).any()):
        raise PluginContractError(f"{where} kept {counts.sum(-1).tolist()} tokens per batch row, more than the "
                                  f"layer's budget {torch.as_tensor(budget).tolist()} {fix}")
    K = int(counts.max()) if counts.numel() else 0
    return sel if idx.shape[2] == K else attrs.evolve(sel, index=idx[..., idx.shape[2] - K:])


def _check_merge(merge, idx, kept, B, Hkv, T, where, fix) -> None:
    E = merge.evicted.shape[-1]
    if (merge.evicted.dim() != 3 or tuple(merge.targets.shape[:3]) != (B, Hkv, E)
            or merge.weights.shape != merge.targets.shape or not merge.streams <= {"key", "value"}
            or (merge.target_scale is not None and tuple(merge.target_scale.shape) != (B, Hkv, T))):
        scale = None if merge.target_scale is None else tuple(merge.target_scale.shape)
        raise PluginContractError(f"{where} returned a merge of inconsistent shapes: evicted "
                                  f"{tuple(merge.evicted.shape)}, targets {tuple(merge.targets.shape)}, weights "
                                  f"{tuple(merge.weights.shape)}, target_scale {scale}, streams "
                                  f"{sorted(merge.streams)}; expected evicted [{B}, {Hkv}, E], targets and "
                                  f"weights [{B}, {Hkv}, E, M], target_scale [{B}, {Hkv}, {T}] {fix}")
    is_kept = torch.zeros(B, Hkv, T, dtype=torch.bool, device=idx.device)
    is_kept.scatter_(-1, idx.clamp(0, T - 1), kept)
    used = merge.weights != 0
    hits = is_kept.gather(-1, merge.targets.reshape(B, Hkv, -1).clamp(0, T - 1)).view_as(used)
    finite = torch.isfinite(merge.weights).all()
    if merge.target_scale is not None:
        finite = finite & torch.isfinite(merge.target_scale).all()
    inside = ((merge.evicted >= 0) & (merge.evicted < T)).all() & ((merge.targets >= 0) & (merge.targets < T)).all()
    if bool(hits[used].all() & finite & inside):  # one sync for the three
        return
    if not bool(inside):
        raise PluginContractError(f"{where} returned merge columns outside [0, {T}) {fix}")
    if not bool(finite):
        raise PluginContractError(f"{where} returned merge weights or target_scale that are not finite "
                                  f"(NaN or inf); expected finite weights {fix}")
    raise PluginContractError(f"{where} merges into tokens it does not keep (a target with a non-zero weight is "
                              f"not in the selection) {fix}")


# -- allocators ------------------------------------------------------------------------------------

def checked_budgets(allocator, budgets: Any, request) -> torch.Tensor:
    """``allocator.allocate(request)`` as int64 [n] or [n, Hkv] budgets, clipped to [1, context_tokens]
    as the runtime uses them; each layer's largest budget within ``allocator.bound`` (the memory model
    reports that bound before run time)."""
    name = allocator.name
    n, Hkv, T = len(request.layers), request.num_kv_heads, request.context_tokens
    head = f"layers {list(request.layers)} (prefill): allocator '{name}'"
    try:
        got = torch.as_tensor(budgets)
    except (TypeError, ValueError, RuntimeError):
        raise PluginContractError(f"{head} allocate() returned a {type(budgets).__name__}; expected int64 [{n}] or "
                                  f"[{n}, {Hkv}] budgets (fix the allocator's allocate())") from None
    if got.dtype.is_floating_point or got.dtype == torch.bool or tuple(got.shape) not in ((n,), (n, Hkv)):
        raise PluginContractError(f"{head} returned budgets of shape {tuple(got.shape)} and dtype {got.dtype}; "
                                  f"expected int [{n}] or [{n}, {Hkv}] (fix the allocator's allocate())")
    got = got.long().clamp(1, T)
    bound = allocator.bound(request.capacities, T)
    most = dict(zip(request.group_layers, bound))
    for layer, b in zip(request.layers, got):
        top = int(b.max())
        if top > int(most[layer]):
            raise PluginContractError(f"layer {layer} (prefill): allocator '{name}' gave a budget of {top} tokens per "
                                      f"head, above its bound() of {int(most[layer])}, which the memory model "
                                      f"reports; fix allocate() or bound()")
    return got


# -- stores ----------------------------------------------------------------------------------------

def store_head(layer: int, phase: str, quantizer: str | None, bits: int, stream: str) -> str:
    """``layer 0 (prefill): quantizer 'kivi' (4-bit key store)``; a 16-bit stream is ``store '16-bit'``."""
    kind, name = ("store", "16-bit") if quantizer is None else ("quantizer", quantizer)
    return f"{where(layer, phase, kind, name)} ({bits}-bit {stream} store)"


@attrs.define(frozen=True)
class StreamSpec:
    """What one stream's store is: its quantizer (None for 16 bits), by name and as an object, and its bits."""

    name: str | None
    bits: int
    quantizer: Any = None


class StoreContract:
    """The store checks of one layer's :class:`~polykv.runtime.storage.LayerStorage`.

    The storage calls :meth:`after` once per fill, append, gather and write, :meth:`written` with each
    write's cost and :meth:`read` with every dequantized read. ``streams`` maps ``"key"``/``"value"`` to
    their :class:`StreamSpec`; ``storage_dtype`` is the dtype the stores keep (None: the compute dtype).
    """

    def __init__(self, *, layer_idx: int, streams: dict[str, StreamSpec], storage_dtype: torch.dtype | None,
                 full: bool):
        self.layer_idx, self.streams = layer_idx, streams
        self.storage_dtype, self.full = storage_dtype, full
        self.head_dim: int | None = None
        self.widths: dict[str, int] = {}
        """Channels per token of each stream (the head dim, or a low-rank layer's code width)."""
        self.dtype: torch.dtype | None = None
        """The compute dtype reads must come back in (recorded when the prompt is stored)."""

    @classmethod
    def for_plan_layer(cls, layer_idx: int, plan_layer, registry, *, storage_dtype=None, full: bool = False):
        """The checks of a plan layer's stores (its quantizer built from the registry, as the stores are)."""
        streams = {}
        quantizer = None
        for stream in ("key", "value"):
            bits = plan_layer.k_bits if stream == "key" else plan_layer.v_bits
            if bits == UNQUANTIZED_BITS:
                streams[stream] = StreamSpec(None, bits)
                continue
            if quantizer is None:
                quantizer = registry.quantizer(plan_layer.quantizer)(**plan_layer.quantizer_params)
            streams[stream] = StreamSpec(plan_layer.quantizer, bits, quantizer)
        return cls(layer_idx=layer_idx, streams=streams, storage_dtype=storage_dtype, full=full)

    def _head(self, stream: str, phase: str) -> str:
        spec = self.streams[stream]
        return store_head(self.layer_idx, phase, spec.name, spec.bits, stream)

    def _stores(self, storage):
        """(stream, store, tokens the runtime stored, batch, heads) for every store of the layer."""
        if not storage.ragged:
            B, H = storage.shape
            n = storage.uniform_count()
            yield "key", storage.key_store, n, B, H
            yield "value", storage.value_store, n, B, H
            return
        for seg in storage.segments:
            yield "key", seg.key, seg.length, 1, 1
            yield "value", seg.value, seg.length, 1, 1

    def after(self, call: str, storage, *, keys: torch.Tensor | None = None,
              values: torch.Tensor | None = None) -> None:
        """After ``call`` ("fill", "append", "gather", "write"): every store's ``len`` equals the tokens the
        runtime stored; after "fill" its resident bytes equal the prediction; with the expensive checks on,
        every store dequantizes to [batch, heads, tokens, head_dim] in the compute dtype."""
        phase = "prefill" if call == "fill" else "decode"
        if keys is not None:
            self.head_dim, self.dtype = int(keys.shape[-1]), keys.dtype
            self.widths = {"key": self.head_dim, "value": int((keys if values is None else values).shape[-1])}
        for stream, store, n, B, H in self._stores(storage):
            got = len(store)
            if got != n:
                raise PluginContractError(f"{self._head(stream, phase)} holds len(store) = {got} tokens after {call}; "
                                          f"expected {n}, the tokens the runtime stored (fix the store's {call} "
                                          f"or __len__)")
            if self.full:
                self.read(stream, store.dequantize(), n, B, H, phase=phase, call=call)
        if call == "fill":
            self._check_bytes(storage)

    def read(self, stream: str, x: torch.Tensor, tokens: int, batch: int, heads: int, *, phase: str = "decode",
             call: str = "read") -> torch.Tensor:
        """``store.dequantize()`` of ``tokens`` tokens must be [batch, heads, tokens, head_dim] in the compute dtype."""
        want = (batch, heads, tokens, self.widths.get(stream, self.head_dim))
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        if shape != want or (self.dtype is not None and x.dtype != self.dtype):
            dtype = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise PluginContractError(f"{self._head(stream, phase)} dequantize() after {call} returned shape {shape} "
                                      f"{dtype}; expected {want} {self.dtype} (fix the store's dequantize())")
        return x

    def written(self, stream: str, store, mask: torch.Tensor, cost: Any) -> Any:
        """A write's return value is a :class:`~polykv.contract.stores.WriteCost`; with the expensive checks on, it
        wrote exactly the masked tokens and its re-encode counts are not negative."""
        from polykv.contract.stores import WriteCost

        head = self._head(stream, "decode")
        if not isinstance(cost, WriteCost):
            raise PluginContractError(f"{head} write() returned a {type(cost).__name__}; expected a "
                                      f"polykv.contract.stores.WriteCost (fix the store's write())")
        if self.full:
            n = int(mask.sum())
            if cost.tokens_written != n or min(cost.tokens_requantized, cost.groups_requantized) < 0:
                raise PluginContractError(f"{head} write() reported {cost}; expected tokens_written = {n} (the "
                                          f"masked tokens) and non-negative re-encode counts (fix the store's "
                                          f"write())")
        return cost

    def _check_bytes(self, storage) -> None:
        """Right after the prompt is stored each store is fresh: reserved, then appended once; its resident
        bytes must equal :func:`polykv.storage.token_buffer.reserved_stream_bytes` (the memory model's prediction)."""
        held = self.storage_dtype or self.dtype
        for stream, store, n, B, H in self._stores(storage):
            spec = self.streams[stream]
            rows = storage.reserve_rows(n)
            predicted = reserved_stream_bytes(spec.quantizer, stream, spec.bits, tokens=n, reserved=rows, batch=B,
                                              kv_heads=H, head_dim=self.widths.get(stream, self.head_dim),
                                              dtype_bytes=held.itemsize)
            measured = int(store.resident_bytes())
            if measured != predicted:
                raise PluginContractError(
                    f"{self._head(stream, 'prefill')} holds {measured} resident bytes for {n} tokens ({B} x {H} "
                    f"heads, {rows} rows reserved); expected {predicted} from its predict_reserved_bytes / "
                    f"predict_bytes (count every tensor the store keeps: codes, scales, zeros, residuals)")


class NoContract:
    """The store checks of a storage built outside a layer cache (tests), or of a 16-bit layer's own buffers
    while the expensive checks are off: none."""

    def after(self, call, storage, *, keys=None, values=None) -> None:
        pass

    def read(self, stream, x, tokens, batch, heads, **_):
        return x

    def written(self, stream, store, mask, cost):
        return cost
