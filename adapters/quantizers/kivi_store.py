"""What KIVI's key and value stores share: the quantized part's buffers, the residual, and the steps of an
append, a read, a gather and a write that do not depend on how tokens are grouped.

The quantized part (codes, scales, minima; keys also group ids) lives in
:class:`polykv.storage.token_buffer.TokenBuffer` s: ``[B, Hkv, C, c]`` buffers whose first rows are in use.
Two modes:

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

A subclass says how its tokens are grouped: :attr:`KiviStore.layout` (``"channel"`` or ``"token"``, see
:mod:`polykv.adapters.quantizers.code_format`), how many of the oldest tokens an append quantizes
(``_to_quantize``), how it quantizes them (``_quantize_rows``), and the trailing shapes of its buffers.
"""

from __future__ import annotations

import torch

from polykv.contract import KVStore, storage
from polykv.adapters.quantizers import code_format
from polykv.adapters.quantizers.packed_stream import PackedStream


class KiviStore(KVStore):
    """Base of the KIVI stores (see the module docstring)."""

    what: str
    """How the store names itself in errors (``"kivi keys"``, ``"kivi values"``)."""
    layout: str
    """Its code layout (:mod:`polykv.adapters.quantizers.code_format`)."""
    _grow_in_blocks: bool
    """Past the reserve, grow by whole GROWTH_BLOCK rows (a store that adds a row per token); False: to
    exactly the rows needed (a store that adds whole blocks of rows at a time)."""

    def __init__(self, *, bits: int, group_size: int, residual: int, dtype: torch.dtype,
                 device: torch.device | str, **extra: torch.dtype):
        self.bits, self.group_size, self.residual_len = bits, group_size, residual
        self.dtype, self.device = dtype, torch.device(device)
        self._shape: tuple[int, int, int] | None = None  # (B, Hkv, d)
        dtypes = {"codes": torch.uint8, "scale": dtype, "zero": dtype, **extra}
        self._buffers = {name: storage.TokenBuffer(dtype=dt, device=self.device) for name, dt in dtypes.items()}
        self._reserved = False
        self.residual: torch.Tensor | None = None

    def _trails(self, d: int) -> dict[str, tuple[int, ...]]:
        """Each buffer's trailing shape for head dim ``d``."""
        raise NotImplementedError

    def _init(self, B: int, H: int, d: int) -> None:
        """Allocate every buffer for (B, Hkv, d), with the rows reserved so far (none in exact mode)."""
        for name, trail in self._trails(d).items():
            buf = self._buffers[name]
            buf.reserve(buf.pending, (B, H, *trail))
        self.residual = torch.empty(B, H, 0, d, dtype=self.dtype, device=self.device)

    # -- the buffers ------------------------------------------------------------------------------
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
    def group_ids(self) -> torch.Tensor | None:
        """[B, Hkv, Tq] int32 group row of every quantized key, or None (values; keys while groups are implicit)."""
        return None

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

    def resident_bytes(self) -> int:
        return storage.held_bytes(*(b.data for b in self._buffers.values() if b.data is not None), self.residual)

    # -- appends ----------------------------------------------------------------------------------
    def _to_quantize(self, held: int) -> int:
        """How many of the oldest of ``held`` full-precision tokens an append quantizes."""
        raise NotImplementedError

    def _quantize_rows(self, x: torch.Tensor) -> None:
        """Quantize the oldest full-precision tokens ``x`` [B, Hkv, n, d] and append them to the codes."""
        raise NotImplementedError

    def append(self, x: torch.Tensor) -> None:
        """Append ``x`` [B, Hkv, t, d]; the oldest full-precision tokens past the residual's policy are quantized."""
        if self._shape is None:
            self._shape = storage.check_chunk(x, None, self.what)
            self._init(*self._shape)
        storage.check_chunk(x, self._shape, self.what)
        if not x.shape[2]:
            return
        x = storage.own_copy(x, dtype=self.dtype, device=self.device)
        res = x if not self.residual.shape[2] else torch.cat([self.residual, x], dim=2)
        n = self._to_quantize(res.shape[2])
        if n > 0:
            self._quantize_rows(res[:, :, :n])
            res = res[:, :, n:].clone()  # own storage: a slice would keep the whole buffer alive
        self.residual = res

    # -- reads ------------------------------------------------------------------------------------
    def _check_filled(self) -> None:
        if self._shape is None:
            raise ValueError(f"{self.what}: the store is empty; append tokens before reading it")

    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] in the compute dtype: quantized tokens, then the residual."""
        self._check_filled()
        B, H, d = self._shape
        Tq = self.num_quantized
        out = torch.empty(B, H, len(self), d, dtype=self.dtype, device=self.device)
        code_format.decode_rows(out[:, :, :Tq], self.layout, self.bits, self.group_size, self.codes, self.scale,
                                self.zero, self.group_ids, 0)
        out[:, :, Tq:] = self.residual
        return out

    def token_blocks(self) -> PackedStream:
        """The stored tensors as a token-blocks view (attention reads codes directly; no copy)."""
        self._check_filled()
        return PackedStream(layout=self.layout, bits=self.bits, group_size=self.group_size, codes=self.codes,
                            scale=self.scale, zero=self.zero, group_ids=self.group_ids, residual=self.residual)

    # -- gathers, writes, splits ------------------------------------------------------------------
    def _split_index(self, index: torch.Tensor):
        """A gather's index checked and split (see the subclasses' ``gather``): (residual survivors per head
        [B, H], residual tokens every head keeps, quantized survivors per head, their indices [B, H, nq]
        (logical order), the kept residual's indices [B, H, k - nq] (residual order), which of the quantized
        survivors were residual tokens [B, H, nq])."""
        index = storage.check_index(index.to(self.device), self._shape, len(self), self.what)
        Tq, k = self.num_quantized, index.shape[2]
        n_res = (index >= Tq).sum(-1)  # (B, H) residual survivors per head
        keep_res = int(n_res.min()) if k else 0
        nq = k - keep_res
        iq, ir = index[..., :nq], index[..., nq:] - Tq
        return n_res, keep_res, nq, iq, ir, iq >= Tq

    def _split_write(self, mask: torch.Tensor, x: torch.Tensor):
        """A write checked; the residual's tokens written in full precision; (mask over the quantized tokens
        [B, H, Tq], the number of tokens written)."""
        B, H, d = self._shape
        storage.check_write(mask, x, (B, H, len(self), d), self.what)
        Tq = self.num_quantized
        self.residual = torch.where(mask[..., Tq:].unsqueeze(-1), x[:, :, Tq:].to(self.dtype), self.residual)
        return mask[..., :Tq], int(mask.sum())

    def _fill_head(self, b: int, h: int) -> "KiviStore":
        """A new store for head (b, h) of this one, with its residual and (subclasses) its codes."""
        s = type(self)(bits=self.bits, group_size=self.group_size, residual=self.residual_len,
                       dtype=self.dtype, device=self.device)
        s._shape = (1, 1, self._shape[2])
        s._init(*s._shape)
        s.residual = self.residual[b:b + 1, h:h + 1].clone()
        return s

    def split_heads(self) -> list["KiviStore"]:
        """One store per (batch row, KV head), row-major, keeping that head's codes (no requantization)."""
        B, H, _ = self._shape
        return [self._fill_head(b, h) for b in range(B) for h in range(H)]
