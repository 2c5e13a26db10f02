"""Token storage of one layer: key and value stores plus positions, uniform or ragged across KV heads,
and the stores themselves, built from the plan layer's quantizer and bit widths (:func:`new_store`); what
attention reads straight from them (:meth:`LayerStorage.attend`).

*Uniform* storage is one key store and one value store of shape [B, Hkv, T, d] and positions
[B, Hkv, T]: every head holds T tokens. A ragged :class:`~polykv.contract.selection.Selection` turns a layer
*ragged*: each (batch row, KV head) then owns its own key store, value store and positions, holding
exactly its tokens, so memory is really freed (nothing is masked in place). For attention and
selection, :meth:`LayerStorage.view` pads the heads to the longest one, right-aligned (padding
first, every head's newest token in the last column), with a ``valid`` mask that attention uses so
that no padding column is ever attended.

Every later selection, merge and append goes through the same three calls, whatever the layout:
:meth:`append` (new tokens), :meth:`view` (what attention and rules read), :meth:`evict` (merge,
then gather). Each does the uniform layout here and hands a ragged layer to its ragged half
(:class:`~polykv.runtime.ragged.RaggedHeads`), so a uniform layer runs none of the per-head code.
Shapes: B batch, Hkv KV heads, T stored tokens (padded width when ragged), d head dim.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from polykv.attention.online_softmax import decode_attention_from_stores, decode_attention_per_head
from polykv.contract.stores import KVStore, WriteCost
from polykv.contract.selection import Selection
from polykv.plan import PASSTHROUGH_BITS, LayerPlan
from polykv.runtime.ragged import RaggedHeads, Segment
from polykv.storage.token_buffer import PassthroughStore, TokenBuffer, gather_tokens, reserve_store, reserve_tokens
from polykv.errors import RuntimeConfigError
from polykv.storage.layer_share import DEFAULT_INTERPOLATION, DEFAULT_RETENTION_RATIO, SharedStore, merge_pair


def quantizer_of(registry, lp: LayerPlan):
    """The quantizer object of plan layer ``lp`` (``registry.quantizer(lp.quantizer)(**lp.quantizer_params)``), or
    None when both streams are kept at 16 bits: built once per layer, for its stores and their checks."""
    if lp.k_bits == PASSTHROUGH_BITS and lp.v_bits == PASSTHROUGH_BITS:
        return None
    return registry.quantizer(lp.quantizer)(**lp.quantizer_params)


def new_store(quantizer, lp: LayerPlan, stream: str, *, dtype: torch.dtype, device: torch.device,
              storage_dtype: torch.dtype | None = None) -> KVStore:
    """An empty store for ``stream`` ("key" or "value") of plan layer ``lp``.

    Widths below 16 come from the layer's ``quantizer`` (:func:`quantizer_of`); 16 bits is the passthrough
    store, which keeps tensors in the compute dtype. ``storage_dtype`` (e.g. bfloat16 while the model computes
    in float32) is the dtype the store keeps unquantized tensors, scales and residuals in; reads come back in
    the compute ``dtype``.
    """
    held = dtype if storage_dtype is None else storage_dtype
    bits = lp.k_bits if stream == "key" else lp.v_bits
    if bits == PASSTHROUGH_BITS:
        store = passthrough_store(dtype=held, device=device)
    else:
        store = quantizer.new_store(stream, bits, dtype=held, device=device)
    return store if held == dtype else StorageCast(store, dtype)


def passthrough_store(*, dtype: torch.dtype, device: torch.device) -> KVStore:
    """The 16-bit store: unquantized tensors in the compute dtype. Its gathers are not checked again: the runtime
    gathers a layer's stores only with selections it checked (:func:`~polykv.contract.selection.checked_selection`)
    or built itself (a window's newest tokens, a ragged head's own columns)."""
    return PassthroughStore(dtype=dtype, device=device, checks_gathers=False)


class StorageCast(KVStore):
    """A store kept in a storage dtype whose reads come back in the compute dtype."""

    def __init__(self, inner: KVStore, compute_dtype: torch.dtype):
        self.inner, self.compute_dtype = inner, compute_dtype

    def append(self, x: torch.Tensor) -> None:
        self.inner.append(x)

    def gather(self, index: torch.Tensor) -> None:
        self.inner.gather(index)

    def reserve(self, tokens: int) -> None:
        self.inner.reserve(tokens)

    def write(self, mask: torch.Tensor, x: torch.Tensor):
        return self.inner.write(mask, x)

    def split_heads(self) -> list[KVStore]:
        return [StorageCast(s, self.compute_dtype) for s in self.inner.split_heads()]

    def dequantize(self) -> torch.Tensor:
        return self.inner.dequantize().to(self.compute_dtype)

    def __len__(self) -> int:
        return len(self.inner)

    def resident_bytes(self) -> int:
        return self.inner.resident_bytes()


@attrs.define(frozen=True, kw_only=True)
class StorageView:
    """The stored tokens as dense tensors (ragged heads padded, right-aligned)."""

    keys: torch.Tensor
    """[B, Hkv, T, d] dequantized keys (zeros on padding)."""
    values: torch.Tensor
    """[B, Hkv, T, d] dequantized values (zeros on padding)."""
    positions: torch.Tensor
    """[B, Hkv, T] int64 original positions (-1 on padding)."""
    valid: torch.Tensor | None
    """[B, Hkv, T] bool, False on padding; None when the storage is uniform."""

    def take(self, sel: Selection, valid: torch.Tensor | None = None) -> "StorageView":
        """This view at the tokens ``sel`` keeps (``valid``: the padding mask of a ragged selection)."""
        positions = self.positions.gather(-1, sel.index)
        if valid is not None:
            positions = positions.masked_fill(~valid, -1)
        return StorageView(keys=gather_tokens(self.keys, sel.index), values=gather_tokens(self.values, sel.index),
                           positions=positions, valid=valid)


def joined(prompt: StorageView | None, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> StorageView:
    """The unstored ``prompt`` (None: nothing yet) followed by q new ``keys``/``values`` [B, Hkv, q, d] at positions
    ``first_position ..``: a prefill chunk joining the prompt, or a probe forward attending after it."""
    B, Hkv, q, _ = keys.shape
    pos = torch.arange(first_position, first_position + q, device=keys.device).view(1, 1, q).expand(B, Hkv, q)
    if prompt is None:
        return StorageView(keys=keys, values=values, positions=pos.contiguous(), valid=None)
    return StorageView(keys=torch.cat([prompt.keys, keys], dim=2), values=torch.cat([prompt.values, values], dim=2),
                       positions=torch.cat([prompt.positions, pos], dim=-1), valid=None)


class LayerStorage(RaggedHeads):
    """Stores and positions of one layer (see the module docstring).

    Parameters
    ----------
    new_store : callable
        ``new_store(stream)`` -> an empty :class:`~polykv.contract.stores.KVStore` for ``"key"`` or ``"value"``.
    reserve_for : callable, optional
        ``reserve_for(kept, ragged)`` -> token rows to reserve per head for a head holding ``kept``
        tokens right after the prompt is stored or an eviction (:mod:`polykv.storage.token_buffer`); by default
        exactly ``kept``.
    exact_growth : bool
        True for a layer that is cut back (an evicting decode op, a window): an append that does not fit
        grows the buffers to ``reserve_for`` of the new length (another decode slack of room, capped at
        what the layer can hold), not to the next :data:`polykv.storage.token_buffer.GROWTH_BLOCK`.
    contract : StoreContract, optional
        The checks run after every store call (:class:`polykv.runtime.plugin_results.StoreContract`); none by default.
    """

    def __init__(self, new_store: Callable[[str], KVStore],
                 reserve_for: Callable[[int, bool], int] | None = None, *, exact_growth: bool = False,
                 contract=None):
        self._new_store = new_store
        self.contract = contract if contract is not None else NoContract()
        self._exact_growth = exact_growth
        self._reserve_for = reserve_for or (lambda kept, ragged: reserve_tokens(kept, None, slack=0))
        self.key_store: KVStore | None = None
        self.value_store: KVStore | None = None
        self._pos: TokenBuffer | None = None
        self.segments: list[Segment] | None = None
        """Row-major (batch row, head) segments (ragged storage only)."""
        self.shape: tuple[int, int] | None = None
        self.write_cost = WriteCost()
        """What merges written into this layer's stores have cost so far."""

    @property
    def ragged(self) -> bool:
        return self.segments is not None

    @property
    def positions(self) -> torch.Tensor | None:
        """[B, Hkv, T] int64 original positions (uniform storage only; a view of the buffer)."""
        return None if self._pos is None else self._pos.view()

    def _new_positions(self, device) -> TokenBuffer:
        return TokenBuffer(dtype=torch.long, device=device)

    # -- filling ---------------------------------------------------------------------------------
    def fill(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
             counts: torch.Tensor | None = None) -> None:
        """Store the selected prompt tokens [B, Hkv, K, d]; with ``counts`` [B, Hkv] head h keeps its
        last ``counts[b, h]`` columns (right-aligned ragged) in its own stores. Every buffer reserves
        ``reserve_for(kept)`` rows first."""
        B, H, K, _ = keys.shape
        self.shape = (B, H)
        if counts is not None:
            return self._fill_ragged(keys, values, positions, counts)
        rows = self._reserve_for(K, False)
        self.key_store, self.value_store = self._new_store("key"), self._new_store("value")
        self._pos = self._new_positions(positions.device)
        for store in (self.key_store, self.value_store, self._pos):
            reserve_store(store, rows)
        self.key_store.append(keys)
        self.value_store.append(values)
        self._pos.append(positions)
        self.contract.after("fill", self, keys=keys, values=values)

    def append(self, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> None:
        """Append q new tokens [B, Hkv, q, d] at positions ``first_position ..`` to every head (in place)."""
        if self.ragged:
            return self._append_ragged(keys, values, first_position)
        q, n = keys.shape[2], self._pos.length
        if self._exact_growth and n + q > self._pos.capacity:  # a cut-back layer grows by its reserve policy
            rows = self._reserve_for(n + q, False)
            for store in (self.key_store, self.value_store, self._pos):
                reserve_store(store, rows)
        self.key_store.append(keys)
        self.value_store.append(values)
        self._pos.append_arange(first_position, q)
        self.contract.after("append", self)

    # -- reading ---------------------------------------------------------------------------------
    def uniform_count(self) -> int | None:
        """Tokens every head stores (uniform storage), None when ragged."""
        return None if self.ragged else self._pos.length

    def row_totals(self) -> list[int]:
        """Tokens stored per batch row, summed over its KV heads (plain ints)."""
        B, H = self.shape
        if not self.ragged:
            return [self._pos.length * H] * B
        return [sum(seg.length for seg in self.segments[b * H:(b + 1) * H]) for b in range(B)]

    def counts(self) -> torch.Tensor:
        """[B, Hkv] int64 tokens stored per head."""
        B, H = self.shape
        if not self.ragged:
            return torch.full((B, H), self._pos.length, dtype=torch.long)
        return torch.tensor([seg.length for seg in self.segments], dtype=torch.long).view(B, H)

    def reserve_rows(self, kept: int) -> int:
        """Token rows a head holding ``kept`` tokens reserves in this layout (uniform or ragged)."""
        return self._reserve_for(kept, self.ragged)

    def width(self) -> int:
        """Stored tokens of the longest head (the padded width of :meth:`view`)."""
        if not self.ragged:
            return self._pos.length
        return max(seg.length for seg in self.segments)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, H, q, d] over the stored tokens without building the dense view: one call
        over a uniform layer's two stores, or each (batch row, KV head) of a ragged layer over its own segment."""
        if self.ragged:
            return decode_attention_per_head(query, [(seg.key, seg.value) for seg in self.segments], scaling=scaling)
        return decode_attention_from_stores(query, self.key_store, self.value_store, scaling=scaling)

    def view(self) -> StorageView:
        """Dense, dequantized tensors of everything stored (see :class:`StorageView`); uniform 16-bit
        storage returns views of its buffers (no copy)."""
        if self.ragged:
            keys, values, positions, valid = self._padded_heads()
            return StorageView(keys=keys, values=values, positions=positions, valid=valid)
        c, (B, H), n = self.contract, self.shape, self._pos.length
        return StorageView(keys=c.read("key", self.key_store.dequantize(), n, B, H),
                           values=c.read("value", self.value_store.dequantize(), n, B, H),
                           positions=self._pos.view(), valid=None)

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, selection: Selection, view: StorageView) -> None:
        """Apply ``selection`` (columns of ``view``): write its merge into the stores, then keep its tokens."""
        if selection.merge is not None:
            for stream in sorted(selection.merge.streams):
                x = view.keys if stream == "key" else view.values
                merged, touched = selection.merge.apply(x)
                self._write(stream, touched, merged)
        if self.ragged or selection.ragged:
            return self._evict_ragged(selection, view)
        rows = self._reserve_for(selection.index.shape[-1], False)
        for store in (self.key_store, self.value_store, self._pos):
            store.gather(selection.index)
            reserve_store(store, rows)
        self.contract.after("gather", self)

    def _write(self, stream: str, mask: torch.Tensor, x: torch.Tensor) -> None:
        if self.ragged:
            return self._write_ragged(stream, mask, x)
        store = self.key_store if stream == "key" else self.value_store
        self.write_cost += self.contract.written(stream, store, mask, store.write(mask, x))
        self.contract.after("write", self)

    # -- sharing ---------------------------------------------------------------------------------
    def share_prompt(self, lower: "LayerStorage", *, held_dtype: torch.dtype, compute_dtype: torch.dtype,
                     interpolation: float = DEFAULT_INTERPOLATION,
                     retention_ratio: float = DEFAULT_RETENTION_RATIO) -> None:
        """Merge this layer's just-stored prompt with ``lower``'s (the layer below, MiniCache): both layers'
        stores become :class:`~polykv.storage.layer_share.SharedStore` views of one
        :class:`~polykv.storage.layer_share.SharedPair` per stream, and their full-width prompt buffers are
        released. Both layers hold the same prompt tokens, uniformly, and nothing else yet."""
        n = self.uniform_count()
        if self.ragged or lower.ragged or lower.shape is None or lower.uniform_count() != n \
                or len(lower.key_store) != n or not torch.equal(lower.positions, self.positions):
            raise RuntimeConfigError("a shared layer pair must hold the same prompt tokens in both layers when the "
                                     "upper layer stores its prompt (both keep every token)")
        for stream in ("key", "value"):
            attr = f"{stream}_store"
            pair = merge_pair(getattr(lower, attr).dequantize(), getattr(self, attr).dequantize(),
                              interpolation=interpolation, retention_ratio=retention_ratio, dtype=held_dtype)
            device = pair.direction.device
            for side, storage in enumerate((lower, self)):
                setattr(storage, attr, SharedStore(pair, side, compute_dtype=compute_dtype, held_dtype=held_dtype,
                                                   device=device))
        self.contract.after("append", self)
        lower.contract.after("append", lower)

    def share_index_bytes(self) -> int:
        """Bytes of the retained-token indices of a shared pair's key and value streams (0 unless shared)."""
        return sum(s.pair.index_bytes() for s in (self.key_store, self.value_store) if isinstance(s, SharedStore))

    # -- accounting ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Key + value store bytes (codes, scales/zeros, full-precision residuals)."""
        if self.shape is None:
            return 0
        if not self.ragged:
            return int(self.key_store.resident_bytes()) + int(self.value_store.resident_bytes())
        return sum(int(s.key.resident_bytes()) + int(s.value.resident_bytes()) for s in self.segments)

    def positions_bytes(self) -> int:
        """int64 positions: 8 bytes per reserved token row per head (the buffers' bytes)."""
        if self.shape is None:
            return 0
        if not self.ragged:
            return self._pos.nbytes()
        return sum(s.pos.nbytes() for s in self.segments)


class NoContract:
    """The store checks of a storage built outside a layer cache (tests), or of a 16-bit layer's own buffers
    while the expensive checks are off: none."""

    def after(self, call, storage, *, keys=None, values=None) -> None:
        pass

    def read(self, stream, x, tokens, batch, heads, **_):
        return x

    def written(self, stream, store, mask, cost):
        return cost
