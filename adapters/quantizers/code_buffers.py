"""Preallocated buffers of a KIVI store's quantized part (codes, scales, minima, group ids).

Each tensor of the quantized part lives in a :class:`polykv.storage.token_buffer.TokenBuffer`: a ``[B, Hkv, C, c]``
buffer whose first rows are in use. Two modes:

* **exact** (the store was never asked to :meth:`~polykv.contract.stores.KVStore.reserve`): every buffer holds
  exactly its rows in use, so resident bytes depend on the token count only (``predict_bytes``);
* **reserved** (after ``reserve(tokens)``): the store sizes every buffer for the rows it can need while
  it holds up to ``tokens`` tokens, so appends write into free rows in place; a buffer that must hold
  more grows by whole :data:`polykv.storage.token_buffer.GROWTH_BLOCK` blocks counted from its own size (the runtime's
  growth policy, for a store that adds a row per token: values), or to exactly the rows needed (a store
  that adds a block of rows every ``residual`` tokens: keys, whose group rows hold a scale and minimum
  per channel, as costly as two full-precision tokens each); a later ``reserve`` sets the sizes again
  (one reallocation where they change).

The full-precision residual (fewer than ``residual`` keys, at most ``residual`` values) is not part of
these buffers: it is a compact tensor the store rebuilds as tokens move through it, a cost that does
not grow with the context.
"""

from __future__ import annotations

import torch

from polykv.contract import KVStore, storage


class CodeBuffers(KVStore):
    """Base of the KIVI stores: named token buffers for the quantized part (see the module docstring)."""

    _buffers: dict[str, storage.TokenBuffer]
    _shape: tuple[int, int, int] | None = None
    residual: torch.Tensor | None = None
    _reserved: bool = False
    _grow_in_blocks: bool = True

    def _new_buffers(self, *, grow_in_blocks: bool, **dtypes: torch.dtype) -> None:
        """One empty buffer per name, of the given element dtype, on the store's device. ``grow_in_blocks``:
        past the reserve, grow by whole GROWTH_BLOCK rows (a store that adds a row per token); False: to
        exactly the rows needed (a store that adds whole blocks of rows at a time)."""
        self._buffers = {name: storage.TokenBuffer(dtype=dt, device=self.device) for name, dt in dtypes.items()}
        self._reserved, self._grow_in_blocks = False, grow_in_blocks

    @property
    def codes(self) -> torch.Tensor | None:
        """[B, Hkv, Tq, d * bits / 8] uint8 packed codes (a view of the buffer), None before the first append."""
        return None if self._shape is None else self._rows("codes")

    @property
    def scale(self) -> torch.Tensor | None:
        """Scales of the group rows in use (a view), None before the first append."""
        return None if self._shape is None else self._rows("scale")

    @property
    def zero(self) -> torch.Tensor | None:
        """Minima of the group rows in use (a view), None before the first append."""
        return None if self._shape is None else self._rows("zero")

    @property
    def buffers(self) -> dict[str, storage.TokenBuffer]:
        """The quantized part's buffers by name (``codes``, ``scale``, ``zero``; keys also ``ids``), for
        inspection: their ``capacity`` is the rows reserved, ``length`` the rows in use."""
        return dict(self._buffers)

    @property
    def num_quantized(self) -> int:
        """Tokens held as codes (per head; the rest are the full-precision residual)."""
        return self._buffers["codes"].length

    def __len__(self) -> int:
        return 0 if self.residual is None else self.num_quantized + self.residual.shape[2]

    def _allocate(self, **trails: tuple[int, ...]) -> None:
        """Allocate every buffer for the store's (B, Hkv) and each name's trailing shape, with the rows
        reserved so far (none in exact mode)."""
        B, H, _ = self._shape
        for name, trail in trails.items():
            buf = self._buffers[name]
            buf.reserve(buf.pending, (B, H, *trail))

    def _rows(self, name: str) -> torch.Tensor:
        """Rows in use of buffer ``name`` (a view of the buffer)."""
        return self._buffers[name].view()

    @property
    def _grows_exactly(self) -> bool:
        """Whether a buffer that must hold more rows grows to exactly those (exact mode, or a store that adds
        whole blocks of rows), rather than by GROWTH_BLOCK rows."""
        return not (self._reserved and self._grow_in_blocks)

    def _put(self, name: str, x: torch.Tensor) -> None:
        """Append rows ``x`` [B, Hkv, t, ...] to buffer ``name``."""
        self._buffers[name].append(x, exact=self._grows_exactly)

    def _set(self, name: str, x: torch.Tensor) -> None:
        """The rows in use of buffer ``name`` become ``x`` (a gather's or a write's result)."""
        buf = self._buffers[name]
        buf.replace(x, exact=self._grows_exactly)
        if not self._reserved:  # exact mode: the buffer holds exactly its rows in use
            buf.reserve(x.shape[2])

    def _reserve_rows(self, rows: dict[str, int]) -> None:
        """Reserved mode, with buffer ``name`` sized to exactly ``max(rows[name], rows in use)`` rows (rows
        asked before the first append are allocated by it)."""
        self._reserved = True
        for name, n in rows.items():
            self._buffers[name].reserve(n)

    def _buffer_tensors(self) -> list[torch.Tensor]:
        """The allocated buffers (for :func:`polykv.storage.token_buffer.held_bytes`)."""
        return [b.data for b in self._buffers.values() if b.data is not None]
