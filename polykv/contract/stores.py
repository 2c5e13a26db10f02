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


class KVStore:
    """Storage of one tensor stream (keys or values) of one layer: [B, Hkv, T, d] logically."""

    def append(self, x: torch.Tensor) -> None:
        """Append [B, Hkv, t, d] new tokens."""
        raise NotImplementedError

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index`` [B, Hkv, k] (ascending); survivors keep their codes and scales."""
        raise NotImplementedError

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens per head, so that appends up to that many do not reallocate
        (the runtime calls it when the prompt is stored and after each eviction, with the policy of
        :mod:`polykv.storage.reserve`). A store may also release room beyond ``max(tokens, len(self))``.
        Optional: the default does nothing (a store that allocates as it goes)."""

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> "WriteCost":
        """Overwrite the tokens where ``mask`` [B, Hkv, T] (bool, storage order) is True with the
        same columns of ``x`` [B, Hkv, T, d]. A quantized store re-encodes only the quantization
        groups holding written tokens and says how many in the returned :class:`WriteCost`.
        Optional: stores without it cannot serve merging rules (the runtime says so)."""
        raise NotImplementedError(f"{type(self).__name__} has no write path; merging rules need one")

    def split_heads(self) -> list["KVStore"]:
        """One store per (batch row, KV head), row-major, holding that head's tokens without
        re-encoding them. Optional: needed when a layer turns ragged after its stores were filled."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split per head")

    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] tensor in the compute dtype."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Exact bytes held: codes + scales/zeros + full-precision residual (tensor storage only)."""
        raise NotImplementedError


BIT_WIDTHS = (16, 8, 4, 2)
"""The widths a plan may store a stream at, widest first."""
UNQUANTIZED_BITS = 16
"""The width that means "not quantized": the stream stays in the compute dtype (the 16-bit store)."""
QUANTIZED_BITS = tuple(b for b in BIT_WIDTHS if b != UNQUANTIZED_BITS)
"""The widths a quantizer codes (8, 4, 2)."""


@attrs.define(frozen=True)
class WriteCost:
    """What one :meth:`KVStore.write` cost: tokens written, and tokens/groups re-encoded because of it.

    ``tokens_requantized`` counts every stored token whose codes were recomputed (written tokens and
    the other members of the groups they share); 0 for a full-precision store or residual writes.
    """

    tokens_written: int = 0
    tokens_requantized: int = 0
    groups_requantized: int = 0

    def __add__(self, other: "WriteCost") -> "WriteCost":
        return WriteCost(self.tokens_written + other.tokens_written,
                         self.tokens_requantized + other.tokens_requantized,
                         self.groups_requantized + other.groups_requantized)


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
