"""The ``kivi`` quantizer: asymmetric min-max, keys per channel, values per token, packed codes.

KIVI: "A Tuning-Free Asymmetric 2bit Quantization for KV Cache", Liu et al., ICML 2024
(arXiv 2402.02750). Keys are quantized per channel in groups of ``group_size`` consecutive
tokens, a block of ``residual`` keys at a time (the newest incomplete block stays in full
precision); values are quantized per token in groups of ``group_size`` channels, the newest
``residual`` values stay in full precision. Codes are bit-packed into uint8 (8 bits: one byte,
4 bits: half a byte, 2 bits: a quarter per element); scales and minima are stored in the compute
dtype. 16 bits means passthrough (:class:`PassthroughStore`).
"""

from __future__ import annotations

import torch

from polykv.contract import KVStore, ParamError, Quantizer, param, storage
from polykv.adapters.quantizers.kivi_keys import (KiviKeyStore, key_bound_bytes, key_bytes,
                                                  key_reserved_bound_bytes)
from polykv.adapters.quantizers.kivi_values import KiviValueStore, value_bound_bytes, value_bytes
from polykv.adapters.quantizers.code_format import packed_width

STREAMS = ("key", "value")


class KiviQuantizer(Quantizer):
    """KIVI-style quantizer; parameters ``group_size`` (G, default 32) and ``residual`` (R, default 32).

    ``residual`` must be a positive multiple of ``group_size``; the head dim must be a multiple of
    ``group_size`` (value groups) and fill whole bytes at the chosen width.
    """

    name = "kivi"
    bits = frozenset(storage.QUANTIZED_BITS)
    group_size: int = param(32, low=1, high=1 << 16, description="G, tokens or channels per group")
    residual: int = param(32, low=1, high=1 << 20,
                          description="R, newest tokens kept in full precision (a multiple of G)")
    paper = "Liu et al., KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache, ICML 2024, arXiv 2402.02750"

    def __attrs_post_init__(self):
        G, R = self.group_size, self.residual
        if R % G:
            raise ParamError("residual", f"quantizer 'kivi': residual={R} must be a multiple of group_size={G} "
                                         f"(keys are quantized a block of R tokens at a time, in groups of G)")

    def _check(self, stream: str, bits: int) -> None:
        if stream not in STREAMS:
            raise ValueError(f"quantizer 'kivi': unknown stream {stream!r}; use one of {STREAMS}")
        if bits != storage.UNQUANTIZED_BITS and bits not in self.bits:
            raise ValueError(f"quantizer 'kivi' stores {sorted(self.bits)} bits (or {storage.UNQUANTIZED_BITS} = "
                             f"unquantized), not {bits}")

    def check_width(self, stream: str, bits: int, width: int) -> None:
        """Codes are packed into whole bytes (a width that ``8 / bits`` divides), and values are quantized per token
        in groups of ``group_size`` channels (a multiple of it); keys are quantized per channel over tokens."""
        self._check(stream, bits)
        if bits != storage.UNQUANTIZED_BITS:
            packed_width(width, bits)
        G = self.group_size
        if stream == "value" and bits != storage.UNQUANTIZED_BITS and width % G:
            raise ValueError(f"quantizer 'kivi' quantizes values in groups of group_size={G} channels, and {width} "
                             f"channels are not a multiple of it")

    def new_store(self, stream: str, bits: int, *, dtype: torch.dtype, device: torch.device | str) -> KVStore:
        """An empty store: :class:`KiviKeyStore` / :class:`KiviValueStore`, or passthrough for 16 bits."""
        self._check(stream, bits)
        if bits == storage.UNQUANTIZED_BITS:
            return storage.PassthroughStore(dtype=dtype, device=device)
        cls = KiviKeyStore if stream == "key" else KiviValueStore
        return cls(bits=bits, group_size=self.group_size, residual=self.residual,
                   dtype=dtype, device=device)

    def predict_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                      tokens: int, dtype_bytes: int) -> int:
        """Exact resident bytes after ``tokens`` appends (any chunking), no eviction.

        Keys: ``Tq = floor(T / R) * R`` quantized tokens cost ``d * bits / 8`` bytes each plus, per
        group of G tokens, a scale and a minimum per channel (``2 * d * dtype_bytes``); the other
        ``T - Tq`` keys cost ``d * dtype_bytes``. Values: ``Tq = max(T - R, 0)`` quantized tokens cost
        ``d * bits / 8 + 2 * (d / G) * dtype_bytes`` each; the last ``min(T, R)`` cost ``d * dtype_bytes``.
        Everything is per (batch row, KV head).
        """
        return self._bytes(key_bytes, value_bytes, stream, bits, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                           tokens=tokens, dtype_bytes=dtype_bytes)

    def predict_reserved_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                               tokens: int, reserved: int, dtype_bytes: int) -> int:
        """Exact resident bytes of a fresh store asked to ``reserve(reserved)`` before ``tokens`` appends
        (no eviction): the quantized part holds the rows ``reserved`` tokens need (keys:
        ``floor(reserved / R) * R`` code rows and ``/ G`` group rows, grown to exactly what ``tokens`` need
        past them; values: ``reserved - R`` rows, grown by whole :data:`polykv.storage.token_buffer.GROWTH_BLOCK` blocks);
        the residual holds exactly its tokens, as in :meth:`predict_bytes`."""
        return self._bytes(key_bytes, value_bytes, stream, bits, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                           tokens=tokens, dtype_bytes=dtype_bytes, reserved=int(reserved))

    def bound_reserved_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                             tokens: int, reserved: int, dtype_bytes: int) -> int:
        """Most resident bytes after any appends and gathers of a store that holds at most ``tokens`` tokens
        after each forward and is asked to ``reserve(reserved)`` after each eviction (the runtime's reserve
        policy). Its buffers then never exceed ``N = max(tokens, reserved)`` rows: values are bounded by
        :meth:`bound_bytes` at N tokens; keys by N rows of codes, group ids and (worst case) their own
        scale and minimum rows, plus up to ``residual - 1`` keys in the compute dtype beside them."""
        return self._bytes(key_reserved_bound_bytes, value_bound_bytes, stream, bits, batch=batch, kv_heads=kv_heads,
                           head_dim=head_dim, tokens=max(int(tokens), int(reserved)), dtype_bytes=dtype_bytes)

    def bound_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                    tokens: int, dtype_bytes: int) -> int:
        """Most resident bytes of a store holding at most ``tokens`` tokens after any appends and gathers.

        Gathers never requantize, so survivors keep what they had: a surviving key keeps its group's
        scale and minimum row (in the worst case one row per surviving key, plus an int32 group id
        each), and up to ``residual - 1`` keys or ``residual`` values stay in the compute dtype.
        """
        return self._bytes(key_bound_bytes, value_bound_bytes, stream, bits, batch=batch, kv_heads=kv_heads,
                           head_dim=head_dim, tokens=tokens, dtype_bytes=dtype_bytes)

    def _bytes(self, key_fn, value_fn, stream: str, bits: int, *, head_dim: int, **shape) -> int:
        """``key_fn`` / ``value_fn`` of this store's layout (16 bits: the passthrough count)."""
        self._check(stream, bits)
        shape["head_dim"] = head_dim
        if bits == storage.UNQUANTIZED_BITS:
            return storage.passthrough_bytes(**shape)
        G, R = self.group_size, self.residual
        if stream == "value" and head_dim % G:
            raise ValueError(f"quantizer 'kivi': head_dim {head_dim} is not a multiple of group_size={G}; "
                             f"set quantizer_params.group_size to a divisor of {head_dim}")
        fn = key_fn if stream == "key" else value_fn
        return fn(bits=bits, group_size=G, residual=R, **shape)
