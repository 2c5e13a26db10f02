"""The store a layer's stream (keys or values) lives in: :class:`KVStore`, what one write cost
(:class:`WriteCost`) and the bit widths a plan may store a stream at.

The lowest storage module: the token buffer (the 16-bit store), cross-layer sharing and every quantizer's
store implement :class:`KVStore`; the plugin contract offers these types to quantizer plugins
(:mod:`polykv.contract.stores`).

Shapes: B batch, Hkv key/value heads, T stored tokens, d head dim.
"""

from __future__ import annotations

import attrs
import torch


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
        :mod:`polykv.storage.token_buffer`). A store may also release room beyond ``max(tokens, len(self))``.
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
