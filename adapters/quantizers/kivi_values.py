"""KIVI value storage: per-token quantization in groups of G channels, last R tokens full precision.

KIVI: "A Tuning-Free Asymmetric 2bit Quantization for KV Cache", Liu et al., ICML 2024
(arXiv 2402.02750). Values are quantized per token; the ``residual`` most recent values stay in
the compute dtype and the oldest one is quantized as each new value arrives.

Layout (logical storage order = quantized tokens, then residual tokens):
``codes`` [B, Hkv, Tq, d * bits / 8] uint8, ``scale`` and ``zero`` [B, Hkv, Tq, d / G] in the
compute dtype, ``residual`` [B, Hkv, Tr, d] in the compute dtype. Codes, scales and minima are the
rows in use of preallocated buffers (:mod:`polykv.adapters.quantizers.kivi_store`).
"""

from __future__ import annotations

import torch

from polykv.contract import storage
from polykv.adapters.quantizers.code_format import packed_width, quantize_groups
from polykv.adapters.quantizers.kivi_store import KiviStore

PARTS = ("codes", "scale", "zero")


class KiviValueStore(KiviStore):
    """Values of one layer at ``bits`` in {2, 4, 8}; see the module docstring for the layout."""

    what, layout, _grow_in_blocks = "kivi values", "token", True

    def reserve(self, tokens: int) -> None:
        """Size the buffers so that appends up to ``tokens`` tokens in all write in place: values quantize
        only past the last ``residual``, so the quantized part needs ``max(Tq, tokens - residual)`` rows."""
        rows = max(self.num_quantized, int(tokens) - self.residual_len, 0)
        self._reserve_rows(dict.fromkeys(PARTS, rows))

    def _trails(self, d: int) -> dict[str, tuple[int, ...]]:
        G = self.group_size
        if d % G:
            raise ValueError(f"kivi values: head_dim {d} is not a multiple of group_size={G}; set the layer's "
                             f"quantizer_params.group_size to a divisor of {d}")
        return {"codes": (packed_width(d, self.bits),), "scale": (d // G,), "zero": (d // G,)}

    # -- quantization -----------------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, H, n, d] -> (packed codes [B, H, n, d*b/8], scale [B, H, n, d/G], zero [B, H, n, d/G])."""
        B, H, n, d = x.shape
        G = self.group_size
        return quantize_groups(x, (B, H, n, d // G, G), -1, self.bits, self.dtype)

    def _to_quantize(self, held: int) -> int:
        """Every value older than the last ``residual``."""
        return held - self.residual_len

    def _quantize_rows(self, x: torch.Tensor) -> None:
        for name, rows in zip(PARTS, self._quantize(x)):
            self._put(name, rows)

    def gather(self, index: torch.Tensor) -> None:
        """Keep tokens ``index`` [B, Hkv, k] (strictly ascending, logical order); never requantizes.

        Survivors keep their codes, scales and minima. Heads may keep different numbers of residual
        tokens; every head keeps as many residual tokens as the head that kept fewest (``r``), and
        a head's older residual survivors are quantized now, once (their first quantization).
        """
        n_res, keep_res, nq, iq, ir, promoted = self._split_index(index)
        Tq = self.num_quantized
        parts = tuple(self._rows(name) for name in PARTS)
        if Tq:
            at = iq.clamp(max=Tq - 1)
            parts = tuple(storage.gather_tokens(t, at) for t in parts)
        if nq and int(n_res.max()) > keep_res:
            new = self._quantize(storage.gather_tokens(self.residual, (iq - Tq).clamp(min=0)))
            m = promoted.unsqueeze(-1)
            parts = tuple(torch.where(m, p, o) for p, o in zip(new, parts)) if Tq else new
        for name, rows in zip(PARTS, parts):   # nothing quantized survives and nothing is promoted: nq == 0
            self._set(name, rows)
        self.residual = storage.gather_tokens(self.residual, ir)

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> storage.WriteCost:
        """Overwrite the tokens where ``mask`` [B, Hkv, T] is True with ``x`` [B, Hkv, T, d].

        Values are quantized per token, so a written quantized token re-encodes only its own
        ``d / G`` groups; residual tokens are replaced in full precision.
        """
        B, H, d = self._shape
        mq, written = self._split_write(mask, x)
        n = int(mq.sum())
        if n:
            b, h, t = mq.nonzero(as_tuple=True)                      # only the written tokens are encoded
            codes, scale, zero = self._quantize(x[b, h, t].view(1, 1, n, d))
            self.codes[b, h, t], self.scale[b, h, t], self.zero[b, h, t] = codes[0, 0], scale[0, 0], zero[0, 0]
        return storage.WriteCost(tokens_written=written, tokens_requantized=n,
                                 groups_requantized=n * (d // self.group_size))

    def _fill_head(self, b: int, h: int) -> "KiviValueStore":
        s = super()._fill_head(b, h)
        for name in PARTS:
            s._set(name, self._rows(name)[b:b + 1, h:h + 1])
        return s


def value_bytes(*, bits: int, group_size: int, residual: int, batch: int, kv_heads: int, head_dim: int,
                tokens: int, dtype_bytes: int, reserved: int | None = None) -> int:
    """Resident bytes of a :class:`KiviValueStore` after ``tokens`` appends and no eviction; ``reserved``:
    the store was first asked to ``reserve(reserved)`` (None: never, buffers of exactly their rows)."""
    tq = max(tokens - residual, 0)
    tr = tokens - tq
    rows = tq if reserved is None else storage.grown_capacity(tq, max(int(reserved) - residual, 0))
    per_head = (rows * packed_width(head_dim, bits)                     # codes
                + 2 * rows * (head_dim // group_size) * dtype_bytes     # scale + minimum
                + tr * head_dim * dtype_bytes)                          # full-precision residual
    return batch * kv_heads * per_head


def value_bound_bytes(*, bits: int, group_size: int, residual: int, batch: int, kv_heads: int, head_dim: int,
                      tokens: int, dtype_bytes: int) -> int:
    """Most resident bytes of a :class:`KiviValueStore` holding at most ``tokens`` values after any
    appends and gathers: survivors keep their per-token codes, scales and minima, and up to ``residual``
    values stay in the compute dtype (whichever costs more per token fills the bound)."""
    quantized = packed_width(head_dim, bits) + 2 * (head_dim // group_size) * dtype_bytes
    full = head_dim * dtype_bytes
    per_head = max((tokens - tr) * quantized + tr * full for tr in {0, min(residual, tokens)})
    return batch * kv_heads * per_head
