"""Preallocated token buffers and the 16-bit store built on them.

:class:`TokenBuffer` is a ``[B, H, C, *trail]`` tensor whose first ``n`` token rows are in use:
appends copy into rows ``n..n+t`` (growing, by :func:`polykv.storage.reserve.grown_capacity`, only when they
do not fit), :meth:`TokenBuffer.gather` compacts the kept rows to the front of the same buffer, and
reads are views (no copy). The runtime keeps positions in one; :class:`PassthroughStore` (the
16-bit store: keys or values unquantized) keeps its tokens in another.
"""

from __future__ import annotations

import torch

from polykv.storage.store import UNQUANTIZED_BITS, KVStore, WriteCost
from polykv.storage.reserve import capacity_after, grown_capacity
from polykv.storage.store_checks import check_chunk, check_index, check_write, gather_tokens, held_bytes
from polykv.storage.token_blocks import TokenRows


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
        to exactly the rows in use, else by :func:`polykv.storage.reserve.grown_capacity`)."""
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
        ``k`` rows do not fit (``exact``: to exactly ``k`` rows, else by :func:`polykv.storage.reserve.grown_capacity`).
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

    Appends copy into free rows (growing by :data:`polykv.storage.reserve.GROWTH_BLOCK` rows when full);
    :meth:`reserve` sizes the buffer; :meth:`gather` compacts in place; :meth:`dequantize` is a view.
    :meth:`resident_bytes` is the whole buffer, ``B * Hkv * C * d * dtype_bytes`` (C = rows reserved).

    Parameters
    ----------
    dtype : torch.dtype
        Storage dtype (the model's compute dtype: float32 on CPU tests, bfloat16/float16 on GPU).
    device : torch.device or str
        Where the tensors live; appended chunks are copied here.
    """

    bits = UNQUANTIZED_BITS

    def __init__(self, *, dtype: torch.dtype, device: torch.device | str):
        self.dtype = dtype
        self.device = torch.device(device)
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
        index = check_index(index.to(data.device), self._shape, len(self), "passthrough store")
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
                s = PassthroughStore(dtype=self.dtype, device=self.device)
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
    received ``tokens`` tokens without eviction (:func:`polykv.storage.reserve.capacity_after`)."""
    return batch * kv_heads * capacity_after(tokens, reserved) * head_dim * dtype_bytes
