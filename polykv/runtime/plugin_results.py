"""Checks on what plugins return: stores' lengths, shapes and bytes and allocators' budgets here; a rule's scores
and selection where the contract defines them (:func:`polykv.contract.rules.checked_scores`,
:func:`polykv.contract.selection.checked_selection`). The runtime calls them at each call of a plugin method, and
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
from polykv.contract.stores import UNQUANTIZED_BITS
from polykv.errors import PluginContractError
from polykv.storage.token_buffer import reserved_stream_bytes


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
