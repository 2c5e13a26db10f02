"""KIVI value storage: per-token quantization in groups of G channels, last R tokens full precision.

KIVI: "A Tuning-Free Asymmetric 2bit Quantization for KV Cache", Liu et al., ICML 2024
(arXiv 2402.02750). Values are quantized per token; the ``residual`` most recent values stay in
the compute dtype and the oldest one is quantized as each new value arrives.

Layout (logical storage order = quantized tokens, then residual tokens):
``codes`` [B, Hkv, Tq, d * bits / 8] uint8, ``scale`` and ``zero`` [B, Hkv, Tq, d / G] in the
compute dtype, ``residual`` [B, Hkv, Tr, d] in the compute dtype. Codes, scales and minima are the
rows in use of preallocated buffers (:mod:`polykv.adapters.quantizers.code_buffers`).
"""

from __future__ import annotations

import torch

from polykv.contract import storage
from polykv.adapters.quantizers import minmax
from polykv.adapters.quantizers.code_buffers import CodeBuffers
from polykv.adapters.quantizers.packed_stream import PackedStream
from polykv.adapters.quantizers.packing import pack, packed_width


class KiviValueStore(CodeBuffers):
    """Values of one layer at ``bits`` in {2, 4, 8}; see the module docstring for the layout."""

    def __init__(self, *, bits: int, group_size: int, residual: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.bits, self.group_size, self.residual_len = bits, group_size, residual
        self.dtype, self.device = dtype, torch.device(device)
        self._shape: tuple[int, int, int] | None = None  # (B, Hkv, d)
        self._new_buffers(grow_in_blocks=True, codes=torch.uint8, scale=dtype, zero=dtype)
        self.residual: torch.Tensor | None = None

    def reserve(self, tokens: int) -> None:
        """Size the buffers so that appends up to ``tokens`` tokens in all write in place: values quantize
        only past the last ``residual``, so the quantized part needs ``max(Tq, tokens - residual)`` rows."""
        rows = max(self.num_quantized, int(tokens) - self.residual_len, 0)
        self._reserve_rows({"codes": rows, "scale": rows, "zero": rows})

    # -- shape ------------------------------------------------------------------------------------
    def _init(self, B: int, H: int, d: int) -> None:
        G = self.group_size
        if d % G:
            raise ValueError(f"kivi values: head_dim {d} is not a multiple of group_size={G}; set the layer's "
                             f"quantizer_params.group_size to a divisor of {d}")
        self._allocate(codes=(packed_width(d, self.bits),), scale=(d // G,), zero=(d // G,))
        self.residual = torch.empty(B, H, 0, d, dtype=self.dtype, device=self.device)


    # -- quantization -----------------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, H, n, d] -> (packed codes [B, H, n, d*b/8], scale [B, H, n, d/G], zero [B, H, n, d/G])."""
        B, H, n, d = x.shape
        G = self.group_size
        g = x.float().reshape(B, H, n, d // G, G)  # (B, H, n, groups, G)
        scale, zero = minmax.group_params(g.amin(-1), g.amax(-1), self.bits, self.dtype)
        q = minmax.encode(g, scale.unsqueeze(-1), zero.unsqueeze(-1), self.bits).reshape(B, H, n, d)
        return pack(q, self.bits), scale, zero

    def append(self, x: torch.Tensor) -> None:
        """Append ``x`` [B, Hkv, t, d]; values older than the last ``residual`` are quantized."""
        if self._shape is None:
            self._shape = storage.check_chunk(x, None, "kivi values")
            self._init(*self._shape)
        storage.check_chunk(x, self._shape, "kivi values")
        if not x.shape[2]:
            return
        x = storage.own_copy(x, dtype=self.dtype, device=self.device)
        res = x if not self.residual.shape[2] else torch.cat([self.residual, x], dim=2)
        excess = res.shape[2] - self.residual_len
        if excess > 0:
            for name, rows in zip(("codes", "scale", "zero"), self._quantize(res[:, :, :excess])):
                self._put(name, rows)
            res = res[:, :, excess:].clone()  # own storage: a slice would keep the whole buffer alive
        self.residual = res

    # -- reads ------------------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] in the compute dtype: quantized tokens, then the residual."""
        if self._shape is None:
            raise ValueError("kivi values: the store is empty; append tokens before reading it")
        B, H, d = self._shape
        Tq, G = self.num_quantized, self.group_size
        out = torch.empty(B, H, len(self), d, dtype=self.dtype, device=self.device)
        minmax.decode_into(out[:, :, :Tq], self.codes, self.bits, self.scale.unsqueeze(-1),
                           self.zero.unsqueeze(-1), (B, H, Tq, d // G, G))
        out[:, :, Tq:] = self.residual
        return out

    def token_blocks(self) -> PackedStream:
        """The stored tensors as a token-blocks view (attention reads codes directly; no copy)."""
        if self._shape is None:
            raise ValueError("kivi values: the store is empty; append tokens before reading it")
        return PackedStream(layout="token", bits=self.bits, group_size=self.group_size, codes=self.codes,
                            scale=self.scale, zero=self.zero, residual=self.residual)

    def gather(self, index: torch.Tensor) -> None:
        """Keep tokens ``index`` [B, Hkv, k] (strictly ascending, logical order); never requantizes.

        Survivors keep their codes, scales and minima. Heads may keep different numbers of residual
        tokens; every head keeps as many residual tokens as the head that kept fewest (``r``), and
        a head's older residual survivors are quantized now, once (their first quantization).
        """
        index = storage.check_index(index.to(self.device), self._shape, len(self), "kivi values")
        Tq, k = self.num_quantized, index.shape[2]
        n_res = (index >= Tq).sum(-1)  # (B, H) residual survivors per head
        keep_res = int(n_res.min()) if k else 0
        nq = k - keep_res
        iq, ir = index[..., :nq], index[..., nq:] - Tq
        promoted = iq >= Tq  # (B, H, nq) residual tokens that move to the quantized part
        if Tq:
            at = iq.clamp(max=Tq - 1)
            codes, scale, zero = (storage.gather_tokens(t, at) for t in (self.codes, self.scale, self.zero))
        if nq and int(n_res.max()) > keep_res:
            pcodes, pscale, pzero = self._quantize(storage.gather_tokens(self.residual, (iq - Tq).clamp(min=0)))
            if Tq:
                m = promoted.unsqueeze(-1)
                codes, scale, zero = (torch.where(m, p, o) for p, o in
                                      ((pcodes, codes), (pscale, scale), (pzero, zero)))
            else:
                codes, scale, zero = pcodes, pscale, pzero
        elif not Tq:  # nothing quantized survives and nothing is promoted: nq == 0
            codes, scale, zero = self.codes, self.scale, self.zero
        for name, rows in (("codes", codes), ("scale", scale), ("zero", zero)):
            self._set(name, rows)
        self.residual = storage.gather_tokens(self.residual, ir)

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> storage.WriteCost:
        """Overwrite the tokens where ``mask`` [B, Hkv, T] is True with ``x`` [B, Hkv, T, d].

        Values are quantized per token, so a written quantized token re-encodes only its own
        ``d / G`` groups; residual tokens are replaced in full precision.
        """
        B, H, d = self._shape
        storage.check_write(mask, x, (B, H, len(self), d), "kivi values")
        Tq = self.num_quantized
        mq, mr = mask[..., :Tq], mask[..., Tq:]
        n = int(mq.sum())
        if n:
            b, h, t = mq.nonzero(as_tuple=True)                      # only the written tokens are encoded
            codes, scale, zero = self._quantize(x[b, h, t].view(1, 1, n, d))
            self.codes[b, h, t], self.scale[b, h, t], self.zero[b, h, t] = codes[0, 0], scale[0, 0], zero[0, 0]
        self.residual = torch.where(mr.unsqueeze(-1), x[:, :, Tq:].to(self.dtype), self.residual)
        return storage.WriteCost(tokens_written=int(mask.sum()), tokens_requantized=n,
                         groups_requantized=n * (d // self.group_size))

    def split_heads(self) -> list["KiviValueStore"]:
        """One store per (batch row, KV head), row-major, keeping that head's codes (no requantization)."""
        B, H, d = self._shape
        out = []
        for b in range(B):
            for h in range(H):
                s = KiviValueStore(bits=self.bits, group_size=self.group_size, residual=self.residual_len,
                                   dtype=self.dtype, device=self.device)
                s._shape = (1, 1, d)
                s._init(1, 1, d)
                for name in ("codes", "scale", "zero"):
                    s._set(name, self._rows(name)[b:b + 1, h:h + 1])
                s.residual = self.residual[b:b + 1, h:h + 1].clone()
                out.append(s)
        return out

    def resident_bytes(self) -> int:
        return storage.held_bytes(*self._buffer_tensors(), self.residual)


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
