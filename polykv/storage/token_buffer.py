"""Preallocated token buffers, the 16-bit store built on them, how much room they reserve, and the checks of
a store's inputs: the building blocks every KV store uses (the runtime's own and the quantizers').

:class:`TokenBuffer` is a ``[B, H, C, *trail]`` tensor whose first ``n`` token rows are in use:
appends copy into rows ``n..n+t`` (growing, by :func:`grown_capacity`, only when they do not fit),
:meth:`TokenBuffer.gather` compacts the kept rows to the front of the same buffer, and reads are views (no
copy). The runtime keeps positions in one; :class:`PassthroughStore` (the 16-bit store: keys or values
unquantized) keeps its tokens in another. :func:`check_chunk`, :func:`check_index` and :func:`check_write`
check what a store is handed, one line naming the store; :func:`held_bytes` counts what it keeps alive.

**The reserve policy**, one policy shared by the runtime and the memory model.

A layer's stores and positions live in preallocated buffers of ``C`` token rows per KV head
(``C >=`` the tokens stored). Decode appends write into the free rows; eviction compacts the kept
rows to the front of the same buffers. ``C`` is set in three places, always by these functions:

* when the prompt is stored (``kept`` tokens per head), :func:`reserve_tokens`: a layer that is cut
  back between forwards to at most ``hold`` tokens per head (``capacity + decode_slack`` of an
  evicting decode op, an allocator's budget + slack, a window's bound, the smallest that applies)
  reserves ``min(max(kept, hold), kept + slack) + 1`` rows: room for the decode slack's tokens, never
  more than the layer can hold, so one-token decode forwards reallocate at most once per ``slack``
  tokens and a short prompt reserves no more than its own tokens and the slack (not the capacity);
  a layer that keeps everything reserves exactly ``kept`` rows (right after prefill it holds what
  vanilla holds);
* when an append does not fit, :func:`grown_capacity`: a keep-everything buffer grows by whole blocks
  of :data:`GROWTH_BLOCK` rows counted from its own size (it grows at its first decode token, then is
  copied once every ``GROWTH_BLOCK`` tokens, always holding fewer than ``GROWTH_BLOCK`` spare rows; the
  heads of a ragged layer grow together); a layer that is cut back grows to :func:`reserve_tokens` of
  the tokens it now holds instead (another ``slack`` tokens of room, capped at ``hold + 1``; a ratio
  capacity's ``hold`` moves with the tokens seen);
* after an eviction, the layer asks again for :func:`reserve_tokens` of what it now holds; a store
  whose buffer is larger releases the extra rows (one reallocation; e.g. a decode-only rule after its
  first eviction of the whole prompt), a smaller one grows.

A ragged layer (per-head stores) applies the same policy per head with ``hold = kept_h + slack``
(its own count, not the layer's capacity), so no head is padded to the longest.
"""

from __future__ import annotations

import torch

from polykv.storage.store import UNQUANTIZED_BITS, KVStore, WriteCost
from polykv.storage.token_blocks import TokenRows


# -- the reserve policy -------------------------------------------------------------------------------------

DEFAULT_DECODE_SLACK = 128
"""Tokens a decode op may go past its capacity before it evicts (a plan's ``trigger.decode_slack`` default)."""
GROWTH_BLOCK = 16
"""Token rows a keep-everything buffer grows by (and rounds to)."""


def grown_capacity(tokens: int, base: int = 0) -> int:
    """Rows of a buffer of ``base`` rows that grew, a whole :data:`GROWTH_BLOCK` at a time, to hold
    ``tokens``: ``base + GROWTH_BLOCK * ceil((tokens - base) / GROWTH_BLOCK)`` (``base`` when it
    already holds them). Blocks count from the buffer's own size, not from row 0, so buffers that
    reserved different sizes and then receive the same tokens (the heads of a ragged layer) grow
    together and hold the same spare rows."""
    base, extra = int(base), int(tokens) - int(base)
    return base if extra <= 0 else base + -(-extra // GROWTH_BLOCK) * GROWTH_BLOCK


def reserve_tokens(kept: int, hold: int | None, *, slack: int) -> int:
    """Rows to reserve for ``kept`` stored tokens when the layer is cut back to ``hold`` tokens per head
    after every forward (None: never cut back) and decode appends ``slack`` tokens between evictions:
    ``min(max(kept, hold), kept + slack) + 1``, or exactly ``kept`` when nothing bounds the layer (it
    grows by :func:`grown_capacity` when decoding starts)."""
    if hold is None:
        return int(kept)
    return min(max(int(kept), int(hold)), int(kept) + max(int(slack), 0)) + 1


def cut_back_rows(kept: int, new_tokens: int, hold: int, *, slack: int) -> int:
    """Rows of a cut-back layer's buffer (:func:`reserve_tokens` at ``kept``) after ``new_tokens`` one-token
    appends that did not reach ``hold`` (no eviction yet): each append that does not fit grows the buffer
    to :func:`reserve_tokens` of the tokens then held."""
    rows = reserve_tokens(kept, hold, slack=slack)
    held = int(kept)
    for _ in range(int(new_tokens)):
        held += 1
        if held > rows:
            rows = reserve_tokens(held, hold, slack=slack)
    return rows


def capacity_after(tokens: int, reserved: int) -> int:
    """Rows of a buffer that reserved ``reserved`` rows and then received appends up to ``tokens``."""
    return grown_capacity(tokens, reserved)


def layer_hold(*, capacity: int | None, decode_slack: int, bound: int | None) -> int | None:
    """Most tokens per head a layer keeps between forwards: ``capacity + decode_slack`` when its decode op
    evicts (``capacity`` not None), capped by the window ``bound``; None when neither applies."""
    hold = None if capacity is None else int(capacity) + int(decode_slack)
    if bound is not None:
        hold = int(bound) if hold is None else min(hold, int(bound))
    return hold


def reserved_stream_bytes(quantizer, stream: str, bits: int, *, tokens: int, reserved: int, batch: int, kv_heads: int,
                          head_dim: int, dtype_bytes: int) -> int:
    """Bytes of a fresh store that reserved ``reserved`` tokens and then received ``tokens`` (no eviction):
    a 16-bit store (``quantizer`` None) holds its buffer, ``capacity_after(tokens, reserved)`` rows;
    a quantized one says so in :meth:`polykv.contract.stores.Quantizer.predict_reserved_bytes`."""
    if quantizer is None:
        return batch * kv_heads * capacity_after(tokens, reserved) * head_dim * dtype_bytes
    return int(quantizer.predict_reserved_bytes(stream, bits, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                                                tokens=tokens, reserved=reserved, dtype_bytes=dtype_bytes))



def reserve_store(store, tokens: int) -> None:
    """Ask ``store`` to make room for ``tokens`` token rows per head, when it can (``reserve`` is optional)."""
    reserve = getattr(store, "reserve", None)
    if reserve is not None:
        reserve(tokens)

# -- a store's inputs checked, its bytes counted ------------------------------------------------------------

def held_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what they actually keep alive).

    A view keeps its whole base storage alive, so this counts storages, not elements: a store
    that kept a slice of a larger buffer would show it here.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def own_copy(x: torch.Tensor, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh contiguous copy of ``x`` on ``device`` in ``dtype`` that owns exactly its elements."""
    return x.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)


def check_chunk(x: torch.Tensor, shape: tuple[int, int, int] | None, what: str) -> tuple[int, int, int]:
    """Check that ``x`` is [B, Hkv, t, d] and matches the store's (B, Hkv, d); returns (B, Hkv, d)."""
    if x.dim() != 4:
        raise ValueError(f"{what}: append expects [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
    got = (x.shape[0], x.shape[1], x.shape[3])
    if shape is not None and got != shape:
        raise ValueError(f"{what}: appended chunk has (batch, kv_heads, head_dim) = {got} but the store holds "
                         f"{shape}; use one store per layer and stream")
    if not x.is_floating_point():
        raise ValueError(f"{what}: append expects a floating-point tensor, got {x.dtype}")
    return got


def check_index(index: torch.Tensor, shape: tuple[int, int, int] | None, stored: int, what: str) -> torch.Tensor:
    """Check a gather index [B, Hkv, k]: integer, strictly ascending, inside ``[0, stored)``.

    Returns it as int64. Indices refer to logical storage order (the order of :meth:`dequantize`).
    """
    if shape is None:
        raise ValueError(f"{what}: gather on an empty store; append tokens first")
    B, H, _ = shape
    if index.dim() != 3 or index.shape[0] != B or index.shape[1] != H:
        raise ValueError(f"{what}: gather expects an index of shape [{B}, {H}, k], got {tuple(index.shape)}")
    if index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(f"{what}: gather expects integer indices, got {index.dtype}")
    index = index.to(torch.int64)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= stored:
            raise ValueError(f"{what}: gather index out of range [{lo}, {hi}] for {stored} stored tokens")
        if index.shape[2] > 1 and not bool((index[..., 1:] > index[..., :-1]).all()):
            raise ValueError(f"{what}: gather indices must be strictly ascending along the last dim "
                             f"(sort them, e.g. with torch.sort, and drop duplicates)")
    return index



def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, c] at index [B, H, k] along the token dim -> a new [B, H, k, c] tensor."""
    B, H, _, c = x.shape
    return torch.gather(x, 2, index.unsqueeze(-1).expand(B, H, index.shape[2], c))


def check_write(mask: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Check a write: ``mask`` [B, Hkv, T] bool and ``x`` [B, Hkv, T, d] matching the stored [B, Hkv, T, d]."""
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape[:3]):
        raise ValueError(f"{what}: write expects a bool mask of shape {tuple(shape[:3])}, got {tuple(mask.shape)} "
                         f"{mask.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{what}: write expects values of shape {tuple(shape)}, got {tuple(x.shape)}")


# -- the buffer and the 16-bit store ------------------------------------------------------------------------

class TokenBuffer:
    """``[B, H, C, *trail]`` rows of ``dtype`` on ``device``; the first :attr:`length` are in use."""

    def __init__(self, *, dtype: torch.dtype, device: torch.device | str):
        self.dtype, self.device = dtype, torch.device(device)
        self.data: torch.Tensor | None = None
        """The whole buffer (None until the first append, or a reserve with a known shape)."""
        self.length = 0
        self.pending = 0
        """Rows reserved before the shape was known (allocated by the first append)."""
    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def _resize(self, shape: tuple[int, ...], rows: int) -> None:
        B, H, *trail = shape
        new = torch.empty(B, H, rows, *trail, dtype=self.dtype, device=self.device)
        if self.length:
            new[:, :, :self.length].copy_(self.data[:, :, :self.length])
        self.data = new

    def reserve(self, rows: int, shape: tuple[int, ...] | None = None) -> None:
        """Make the buffer exactly ``max(rows, length)`` rows (reallocating only when that differs).
        ``shape`` = ``(B, H, *trail)`` is needed before the first append."""
        rows = max(int(rows), self.length)
        if self.data is None:
            if shape is None:
                self.pending = rows
                return
        elif rows == self.capacity:
            return
        self._resize(tuple(shape) if self.data is None else (*self.data.shape[:2], *self.data.shape[3:]), rows)

    def append(self, x: torch.Tensor, *, exact: bool = False) -> None:
        """Copy ``x`` [B, H, t, *trail] into the next ``t`` rows, growing when they do not fit (``exact``:
        to exactly the rows in use, else by :func:`polykv.storage.token_buffer.grown_capacity`)."""
        t, n = x.shape[2], self.length
        if self.data is None:
            self._resize((*x.shape[:2], *x.shape[3:]), max(t, self.pending) if exact else grown_capacity(t, self.pending))
        elif n + t > self.capacity:
            rows = n + t if exact else grown_capacity(n + t, self.capacity)
            self._resize((*x.shape[:2], *x.shape[3:]), rows)
        self.data[:, :, n:n + t].copy_(x)
        self.length = n + t

    def append_arange(self, start: int, t: int) -> None:
        """Append positions ``start .. start + t - 1`` to every (row, head) of an integer buffer."""
        n = self.length
        if n + t > self.capacity:
            self._resize(tuple(self.data.shape[:2]), grown_capacity(n + t, self.capacity))
        if t == 1:
            self.data[:, :, n].fill_(start)
        else:
            self.data[:, :, n:n + t].copy_(torch.arange(start, start + t, device=self.device))
        self.length = n + t

    def view(self) -> torch.Tensor:
        """The rows in use, [B, H, n, *trail] (a view of the buffer: treat it as read-only)."""
        return self.data[:, :, :self.length]

    def gather(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B, H, k] (ascending), compacted to the front of the same buffer."""
        view = self.view()
        if view.dim() == 3:
            kept = view.gather(2, index)
        else:
            kept = gather_tokens(view.reshape(*view.shape[:3], -1), index)
        k = index.shape[2]
        self.data[:, :, :k].copy_(kept.view(*kept.shape[:3], *view.shape[3:]))
        self.length = k

    def replace(self, x: torch.Tensor, *, exact: bool = False) -> None:
        """The rows in use become ``x`` [B, H, k, *trail], copied to the front of the buffer, growing when
        ``k`` rows do not fit (``exact``: to exactly ``k`` rows, else by :func:`polykv.storage.token_buffer.grown_capacity`).
        ``x`` may be the buffer's own first ``k`` rows (no copy then)."""
        k = x.shape[2]
        if self.data is not None and k <= self.capacity:
            if x.data_ptr() != self.data.data_ptr() or x.stride() != self.data.stride():
                self.data[:, :, :k].copy_(x)
        else:
            B, H, _, *trail = x.shape
            rows = max(k, self.pending) if exact else grown_capacity(k, self.capacity if self.data is not None
                                                                     else self.pending)
            self.data = torch.empty(B, H, rows, *trail, dtype=self.dtype, device=self.device)
            self.data[:, :, :k].copy_(x)
        self.length = k

    def nbytes(self) -> int:
        return 0 if self.data is None else held_bytes(self.data)


class PassthroughStore(KVStore):
    """One unquantized stream of one layer: [B, Hkv, T, d] in ``dtype`` on ``device``, in a preallocated
    :class:`TokenBuffer`.

    Appends copy into free rows (growing by :data:`polykv.storage.token_buffer.GROWTH_BLOCK` rows when full);
    :meth:`reserve` sizes the buffer; :meth:`gather` compacts in place; :meth:`dequantize` is a view.
    :meth:`resident_bytes` is the whole buffer, ``B * Hkv * C * d * dtype_bytes`` (C = rows reserved).

    Parameters
    ----------
    dtype : torch.dtype
        Storage dtype (the model's compute dtype: float32 on CPU tests, bfloat16/float16 on GPU).
    device : torch.device or str
        Where the tensors live; appended chunks are copied here.
    checks_gathers : bool
        Check every :meth:`gather` index (:func:`check_index`). False only for a store whose gathers are
        checked before they reach it: a layer's own 16-bit store, which the runtime gathers with selections it
        has checked (:func:`polykv.contract.selection.checked_selection`) or built itself.
    """

    bits = UNQUANTIZED_BITS

    def __init__(self, *, dtype: torch.dtype, device: torch.device | str, checks_gathers: bool = True):
        self.dtype = dtype
        self.device = torch.device(device)
        self.checks_gathers = checks_gathers
        self.buffer = TokenBuffer(dtype=dtype, device=self.device)
        self._shape: tuple[int, int, int] | None = None  # (B, Hkv, d)

    def __len__(self) -> int:
        return self.buffer.length

    @property
    def capacity(self) -> int:
        """Token rows reserved per head."""
        return self.buffer.capacity

    def reserve(self, tokens: int) -> None:
        """Make room for exactly ``max(tokens, len(self))`` tokens per head (needs one append first, or a
        known shape): later appends within it do not reallocate."""
        self.buffer.reserve(tokens, self._shape and (self._shape[0], self._shape[1], self._shape[2]))

    def append(self, x: torch.Tensor) -> None:
        """Append ``x`` [B, Hkv, t, d] (copied into the buffer, converted to the store's dtype)."""
        if self._shape is None or x.dim() != 4 or x.shape[0] != self._shape[0] or x.shape[1] != self._shape[1] \
                or x.shape[3] != self._shape[2] or not x.is_floating_point():
            self._shape = check_chunk(x, self._shape, "passthrough store")
        if x.shape[2]:
            self.buffer.append(x)
        elif self.buffer.data is None:
            self.buffer.reserve(self.buffer.pending, self._shape)

    def _data(self) -> torch.Tensor:
        if self._shape is None:
            raise ValueError("passthrough store is empty: append tokens before reading it")
        if self.buffer.data is None:
            B, H, d = self._shape
            return torch.empty(B, H, 0, d, dtype=self.dtype, device=self.device)
        return self.buffer.view()

    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] in ``dtype``: a view of the buffer; treat it as read-only."""
        return self._data()

    def token_blocks(self):
        """The stored tokens as a token-blocks view (:class:`~polykv.storage.token_blocks.TokenRows`; no copy)."""
        return TokenRows(residual=self._data())

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index`` [B, Hkv, k] (strictly ascending), compacted in place."""
        data = self._data()
        index = index.to(data.device)
        if self.checks_gathers:
            index = check_index(index, self._shape, len(self), "passthrough store")
        self.buffer.gather(index)

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> WriteCost:
        """Overwrite the tokens where ``mask`` [B, Hkv, T] is True with ``x`` [B, Hkv, T, d] (in place)."""
        data = self._data()
        check_write(mask, x, data.shape, "passthrough store")
        if len(self):
            data.copy_(torch.where(mask.unsqueeze(-1), x.to(self.dtype), data))
        return WriteCost(tokens_written=int(mask.sum()))

    def split_heads(self) -> list["PassthroughStore"]:
        """One store per (batch row, KV head), row-major, holding that head's tokens (copies)."""
        data = self._data()
        out = []
        for b in range(data.shape[0]):
            for h in range(data.shape[1]):
                s = PassthroughStore(dtype=self.dtype, device=self.device, checks_gathers=self.checks_gathers)
                s._shape = (1, 1, data.shape[3])
                s.reserve(data.shape[2])
                s.append(data[b:b + 1, h:h + 1])
                out.append(s)
        return out

    def resident_bytes(self) -> int:
        return self.buffer.nbytes()


def passthrough_bytes(*, batch: int, kv_heads: int, head_dim: int, tokens: int, dtype_bytes: int,
                      reserved: int = 0) -> int:
    """Resident bytes of a :class:`PassthroughStore` that reserved ``reserved`` tokens (0: none) and then
    received ``tokens`` tokens without eviction (:func:`polykv.storage.token_buffer.capacity_after`)."""
    return batch * kv_heads * capacity_after(tokens, reserved) * head_dim * dtype_bytes
