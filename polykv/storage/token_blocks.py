"""A stored stream seen as the tensors that hold it: the *token-blocks* view attention reads.

:class:`TokenRows` is the token-blocks view of :mod:`polykv.attention.online_softmax` for a stream held
in full precision (the 16-bit passthrough store): attention reads it a block of tokens at a time
(:meth:`TokenRows.read`). A quantizer's view subclasses it (``polykv.contract.storage.TokenRows``): it adds
its codes (``num_quantized`` rows ahead of the full-precision ones) and :meth:`TokenRows.dequantize_rows`,
and may offer a fused decode kernel (``fused_kernel(query)``). Nothing is copied when a view is taken.

``residual`` [B, Hkv, Tr, d] holds the full-precision tokens, after the quantized ones. Ragged heads
(heads of a layer holding different token counts) are described by ``quantized_len`` and ``residual_len``
([B, Hkv] int64, None = all ``num_quantized`` / ``Tr``): head h's tokens are its first ``quantized_len[h]``
code rows, then its first ``residual_len[h]`` residual rows; rows past those are padding and never read
into attention.
"""

from __future__ import annotations

import attrs
import torch

from polykv.storage.store import UNQUANTIZED_BITS


@attrs.define(frozen=True, kw_only=True)
class TokenRows:
    """One stream of one layer: full-precision rows, optionally behind a quantizer's code rows."""

    residual: torch.Tensor
    """[B, Hkv, Tr, d] full-precision tokens in the compute dtype."""
    quantized_len: torch.Tensor | None = None
    """[B, Hkv] valid code rows per head (ragged heads), or None."""
    residual_len: torch.Tensor | None = None
    """[B, Hkv] valid residual rows per head (ragged heads), or None."""

    layout = "none"
    """How codes are grouped: ``"none"`` here (no codes); a quantizer's view names its own."""
    bits = UNQUANTIZED_BITS
    codes = None

    def __attrs_post_init__(self):
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
        written into ``out`` when given. A view with codes implements it; this one holds none."""
        raise ValueError(f"{type(self).__name__} holds no code rows (rows {start}..{stop - 1} asked)")

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
            res = self.residual.gather(2, at.unsqueeze(-1).expand(B, H, n, d))    # each head's residual rows
            out = torch.where((j < nq.unsqueeze(-1)).unsqueeze(-1), out, res)
        return out

    def dense(self) -> torch.Tensor:
        """Every logical token: [B, Hkv, padded_len, d] (padding positions hold padded rows)."""
        return self.read(0, self.padded_len)


def with_head_counts(stream: TokenRows, quantized_len: torch.Tensor | None,
                     residual_len: torch.Tensor | None) -> TokenRows:
    """The same tensors with ragged per-head counts (rows past them become padding)."""
    return attrs.evolve(stream, quantized_len=quantized_len, residual_len=residual_len)
