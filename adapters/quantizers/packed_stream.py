"""KIVI's stored streams seen as the tensors that hold them: the token-blocks view of its stores.

:class:`PackedStream` is the *token-blocks* view (``polykv.contract.storage.TokenRows``) of a KIVI key or value
store: attention reads it a block of tokens at a time (:meth:`PackedStream.read` dequantizes only that block,
exactly as the store's ``dequantize`` would) or hands its codes, scales and residual to the fused decode kernel
of the query's device (:meth:`PackedStream.fused_kernel`: :mod:`polykv.adapters.quantizers.kivi_cpu` on the CPU,
:mod:`polykv.adapters.quantizers.kivi_triton` on a GPU). Nothing is copied when a view is taken.

Layouts (see kivi_keys.py / kivi_values.py and code_format.py; logical order = quantized tokens, then residual):

- ``"channel"`` (keys): ``codes`` [B, Hkv, Tq, d*b/8] uint8, ``scale``/``zero`` [B, Hkv, Ng, d], one
  row per group of G tokens; ``group_ids`` [B, Hkv, Tq] or None (token i in row i // G);
- ``"token"`` (values): ``codes`` [B, Hkv, Tq, d*b/8], ``scale``/``zero`` [B, Hkv, Tq, d / G];
- ``"none"`` (16-bit passthrough): no codes, every token in ``residual`` (the 16-bit store's own view,
  ``polykv.contract.storage.TokenRows``, is read by the kernel alike).

``residual`` [B, Hkv, Tr, d] holds the full-precision tokens; ragged heads are described by ``quantized_len``
and ``residual_len`` as in ``TokenRows``.
"""

from __future__ import annotations

import attrs
import torch

from polykv.contract import storage
from polykv.adapters.quantizers import code_format, kivi_cpu

LAYOUTS = ("channel", "token", "none")


@attrs.define(frozen=True, kw_only=True)
class PackedStream(storage.TokenRows):
    """One stream of one layer: codes, scales/minima and residual (see the module docstring)."""

    layout: str
    """``"channel"`` (per-channel key groups), ``"token"`` (per-token value groups) or ``"none"``."""
    bits: int = storage.UNQUANTIZED_BITS
    group_size: int = 1
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None

    def __attrs_post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"packed stream: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.layout == "none") != (self.codes is None):
            raise ValueError("packed stream: codes are required exactly when the layout is quantized")
        super().__attrs_post_init__()

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Code rows ``start .. stop - 1`` (stop <= Tq) dequantized: [B, Hkv, n, d] in the compute dtype,
        written into ``out`` when given (e.g. the front of a block whose tail is residual rows).

        Uses :func:`code_format.decode_rows`, as the stores' ``dequantize`` does, so a token dequantizes to
        the same bits here as in the dense read.
        """
        B, H, _, d = self.residual.shape
        if out is None:
            out = torch.empty(B, H, stop - start, d, dtype=self.residual.dtype, device=self.residual.device)
        return code_format.decode_rows(out, self.layout, self.bits, self.group_size, self.codes, self.scale,
                                       self.zero, self.group_ids, start)

    # -- fused kernel -----------------------------------------------------------------------------
    def fused_kernel(self):
        """The fused decode kernel, ``kernel(query, keys, values, scaling=...)``, with this view as the keys or
        the values: the compiled C kernel for a CPU query (:func:`kivi_cpu.decode_attention`), the Triton
        kernel otherwise (:func:`polykv.adapters.quantizers.kivi_triton.decode_attention`)."""
        return fused_decode_attention

    def fused_ready(self, query: torch.Tensor) -> bool:
        """Whether :meth:`fused_kernel` runs for ``query``: a CPU query with the C kernel built (the first call
        builds it, or says in one warning line why it cannot), or a CUDA query with Triton installed."""
        if query.device.type == "cpu":
            return kivi_cpu.ready(query)
        if query.device.type != "cuda":
            return False
        from polykv.adapters.quantizers import kivi_triton   # imports Triton (a second): only when a CUDA decode asks

        return kivi_triton.available()

    def fused_decode(self, query: torch.Tensor, values: storage.TokenRows, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, H, q, d] over these keys and ``values`` in the fused kernel."""
        return self.fused_kernel()(query, self, values, scaling=scaling)


def fused_decode_attention(query: torch.Tensor, keys: storage.TokenRows, values: storage.TokenRows, *,
                           scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over two token-blocks views in the kernel of the query's device: the
    compiled C kernel on the CPU, Triton elsewhere."""
    if query.device.type == "cpu":
        return kivi_cpu.decode_attention(query, keys, values, scaling=scaling)
    from polykv.adapters.quantizers import kivi_triton   # imports Triton (a second): only when a GPU decode asks

    return kivi_triton.decode_attention(query, keys, values, scaling=scaling)
