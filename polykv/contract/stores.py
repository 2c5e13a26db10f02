"""The store and quantizer contract: what a quantizer plugin implements.

A *quantizer* turns a layer's keys or values into a :class:`KVStore` (codes + scales) that supports
append, gather-by-index without requantizing, a write path for merges (requantizing only the
groups it touches), dequantization, and an exact byte count that :mod:`polykv.memory` predicts.
Building blocks for stores (token buffers, min-max codes, bit packing, the token-blocks view) are
in :mod:`polykv.storage`.

Shapes: B batch, Hkv key/value heads, T stored tokens, d head dim.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs
import torch

from polykv.contract.params import DeclaredParams
from polykv.storage.store import BIT_WIDTHS, QUANTIZED_BITS, UNQUANTIZED_BITS, KVStore, WriteCost  # noqa: F401 (the contract's store types)


class Quantizer(DeclaredParams):
    """Base class of quantizers. ``bits`` are the widths it stores (of :data:`QUANTIZED_BITS`);
    :data:`UNQUANTIZED_BITS` (16) always means passthrough and never reaches a quantizer's store.

    Parameters are typed fields (:func:`polykv.contract.params.param`), as a rule's.
    """

    plugin_kind = "quantizer"
    name: ClassVar[str]
    bits: ClassVar[frozenset[int]]
    paper: ClassVar[str] = ""

    def new_store(self, stream: str, bits: int, *, dtype: torch.dtype, device: torch.device | str) -> KVStore:
        """An empty store for ``stream`` ("key" or "value") at ``bits``."""
        raise NotImplementedError

    def check_width(self, stream: str, bits: int, width: int) -> None:
        """Raise ValueError (saying why) when this quantizer cannot code ``width`` channels per token of ``stream``
        at ``bits``: a low-rank layer stores codes narrower than the head dim (its ``k_rank`` / ``v_rank``). The
        default accepts every width."""

    def predict_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                      tokens: int, dtype_bytes: int) -> int:
        """Exact resident bytes of a fresh store after ``tokens`` tokens were appended (in any
        chunking) with no eviction since; ``dtype_bytes`` is the compute dtype's element size."""
        raise NotImplementedError

    def predict_reserved_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                               tokens: int, reserved: int, dtype_bytes: int) -> int:
        """Exact resident bytes of a fresh store that was asked to :meth:`KVStore.reserve` ``reserved``
        tokens and then received ``tokens`` tokens with no eviction. The default is
        :meth:`predict_bytes` (a store whose ``reserve`` does nothing); a store that preallocates
        overrides both."""
        return self.predict_bytes(stream, bits, batch=batch, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens,
                                  dtype_bytes=dtype_bytes)
