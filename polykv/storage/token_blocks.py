"""A stored stream (KIVI keys, KIVI values or passthrough) seen as the tensors that hold it.

:class:`PackedStream` is the *token-blocks* view of :mod:`polykv.attention.online_softmax`: attention reads
it a block of tokens at a time (:meth:`PackedStream.read` dequantizes only that block, exactly as
the store's ``dequantize`` would) or hands its codes, scales and residual to the fused decode
kernel (:meth:`PackedStream.fused_decode`). Nothing is copied when a view is taken.

Layouts (see kivi_keys.py / kivi_values.py; logical order = quantized tokens, then residual):

- ``"channel"`` (keys): ``codes`` [B, Hkv, Tq, d*b/8] uint8, ``scale``/``zero`` [B, Hkv, Ng, d], one
  row per group of G tokens; ``group_ids`` [B, Hkv, Tq] or None (token i in row i // G);
- ``"token"`` (values): ``codes`` [B, Hkv, Tq, d*b/8], ``scale``/``zero`` [B, Hkv, Tq, d / G];
- ``"none"`` (16-bit passthrough): no codes, every token in ``residual``.

``residual`` [B, Hkv, Tr, d] holds the full-precision tokens. Ragged heads (heads of a layer holding
different token counts) are described by ``quantized_len`` and ``residual_len`` ([B, Hkv] int64,
None = all ``Tq`` / ``Tr``): head h's tokens are its first ``quantized_len[h]`` code rows, then its
first ``residual_len[h]`` residual rows; rows past those are padding and never read into attention.
"""

from __future__ import annotations

import attrs
import torch

from polykv.contract.stores import UNQUANTIZED_BITS
from polykv.storage import minmax
from polykv.storage.store_checks import gather_tokens

LAYOUTS = ("channel", "token", "none")


@attrs.define(frozen=True, kw_only=True)
class PackedStream:
    """One stream of one layer: codes, scales/minima and residual (see the module docstring)."""

    layout: str
    """``"channel"`` (per-channel key groups), ``"token"`` (per-token value groups) or ``"none"``."""
    residual: torch.Tensor
    """[B, Hkv, Tr, d] full-precision tokens in the compute dtype."""
    bits: int = UNQUANTIZED_BITS
    group_size: int = 1
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    quantized_len: torch.Tensor | None = None
    """[B, Hkv] valid code rows per head (ragged heads), or None."""
    residual_len: torch.Tensor | None = None
    """[B, Hkv] valid residual rows per head (ragged heads), or None."""

    def __attrs_post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"packed stream: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.layout == "none") != (self.codes is None):
            raise ValueError("packed stream: codes are required exactly when the layout is quantized")
        B, H = self.residual.shape[:2]
        for name in ("quantized_len", "residual_len"):
            n = getattr(self, name)
            cap = self.num_quantized if name == "quantized_len" else self.residual.shape[2]
            if n is not None and (tuple(n.shape) != (B, H) or n.is_floating_point()
                                  or (n.numel() and (int(n.min()) < 0 or int(n.max()) > cap))):
                raise ValueError(f"packed stream: {name} must be [{B}, {H}] integers in [0, {cap}]")

    # -- shape ------------------------------------------------------------------------------------
    @property
    def num_quantized(self) -> int:
        """Code rows per head in the padded layout (Tq)."""
        return 0 if self.codes is None else self.codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.residual.shape[3]

    @property
    def ragged(self) -> bool:
        return self.quantized_len is not None or self.residual_len is not None

    def head_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, Hkv], [B, Hkv]) int64: valid code rows and valid residual rows of every head."""
        B, H, Tr, _ = self.residual.shape
        kw = dict(dtype=torch.int64, device=self.residual.device)
        nq = self.quantized_len if self.quantized_len is not None else torch.full((B, H), self.num_quantized, **kw)
        nr = self.residual_len if self.residual_len is not None else torch.full((B, H), Tr, **kw)
        return nq.to(**kw), nr.to(**kw)

    @property
    def lengths(self) -> torch.Tensor | None:
        """[B, Hkv] int64 valid tokens per head, or None when every head holds :attr:`padded_len`."""
        if not self.ragged:
            return None
        nq, nr = self.head_counts()
        return nq + nr

    @property
    def padded_len(self) -> int:
        """Tokens per head in the padded logical layout (the longest head)."""
        lengths = self.lengths
        if lengths is None:
            return self.num_quantized + self.residual.shape[2]
        return int(lengths.max()) if lengths.numel() else 0

    # -- reads ------------------------------------------------------------------------------------
    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Code rows ``start .. stop - 1`` (stop <= Tq) dequantized: [B, Hkv, n, d] in the compute dtype,
        written into ``out`` when given (e.g. the front of a block whose tail is residual rows).

        Uses :func:`minmax.decode_into`, the arithmetic of the stores' ``dequantize``, so a token
        dequantizes to the same bits here as in the dense read.
        """
        B, H, _, d = self.residual.shape
        n, G = stop - start, self.group_size
        if out is None:
            out = torch.empty(B, H, n, d, dtype=self.residual.dtype, device=self.residual.device)
        codes = self.codes[:, :, start:stop]
        if self.layout == "token":  # per token: (B, H, n, d / G) rows, G channels each
            minmax.decode_into(out, codes, self.bits, self.scale[:, :, start:stop].unsqueeze(-1),
                               self.zero[:, :, start:stop].unsqueeze(-1), (B, H, n, d // G, G))
            return out
        if self.group_ids is None and start % G == 0 and n % G == 0:  # whole groups: broadcast each row
            rows = slice(start // G, stop // G)
            minmax.decode_into(out, codes, self.bits, self.scale[:, :, rows].unsqueeze(3),
                               self.zero[:, :, rows].unsqueeze(3), (B, H, n // G, G, d))
            return out
        if self.group_ids is None:  # implicit groups: token i uses row i // G
            rows = torch.arange(start, stop, device=out.device) // G
            scale, zero = self.scale[:, :, rows], self.zero[:, :, rows]
        else:
            ids = self.group_ids[:, :, start:stop].long()
            scale, zero = gather_tokens(self.scale, ids), gather_tokens(self.zero, ids)
        minmax.decode_into(out, codes, self.bits, scale, zero, (B, H, n, d))
        return out

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Logical tokens ``start .. stop - 1`` of every head: [B, Hkv, n, d] in the compute dtype.

        Positions past a head's length are padding: they hold whatever the padded rows hold.
        """
        Tq, (B, H, Tr, d) = self.num_quantized, self.residual.shape
        if not self.ragged:  # every head: Tq code rows, then Tr residual rows
            if stop <= Tq:
                return self.dequantize_rows(start, stop)
            if start >= Tq:
                return self.residual[:, :, start - Tq:stop - Tq]
            out = torch.empty(B, H, stop - start, d, dtype=self.residual.dtype, device=self.residual.device)
            self.dequantize_rows(start, Tq, out=out[:, :, :Tq - start])
            out[:, :, Tq - start:] = self.residual[:, :, :stop - Tq]
            return out
        nq, _ = self.head_counts()
        n = stop - start
        out = torch.zeros(B, H, n, d, dtype=self.residual.dtype, device=self.residual.device)
        if start < Tq:  # code row j is token j of every head that holds j quantized tokens
            m = min(stop, Tq) - start
            out[:, :, :m] = self.dequantize_rows(start, start + m)
        if Tr:
            j = torch.arange(start, stop, device=out.device)
            at = (j - nq.unsqueeze(-1)).clamp(0, Tr - 1)             # (B, H, n): residual row of token j
            res = gather_tokens(self.residual, at)
            out = torch.where((j < nq.unsqueeze(-1)).unsqueeze(-1), out, res)
        return out

    def dense(self) -> torch.Tensor:
        """Every logical token: [B, Hkv, padded_len, d] (padding positions hold padded rows)."""
        return self.read(0, self.padded_len)

    # -- fused kernel -----------------------------------------------------------------------------
    def fused_ready(self, query: torch.Tensor) -> bool:
        """Whether :meth:`fused_decode` runs for ``query``: a CUDA query and Triton installed."""
        if query.device.type != "cuda":
            return False
        from polykv.attention import kivi_triton   # imports Triton (a second): only when a CUDA decode asks

        return kivi_triton.available()

    def fused_decode(self, query: torch.Tensor, values: "PackedStream", scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, H, q, d] over these keys and ``values`` in the Triton kernel."""
        from polykv.attention.kivi_triton import decode_attention

        return decode_attention(query, self, values, scaling=scaling)


def with_head_counts(stream: PackedStream, quantized_len: torch.Tensor | None,
                     residual_len: torch.Tensor | None) -> PackedStream:
    """The same tensors with ragged per-head counts (rows past them become padding)."""
    return attrs.evolve(stream, quantized_len=quantized_len, residual_len=residual_len)
