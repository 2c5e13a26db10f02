"""16-bit storage: keys or values kept unquantized in the model's compute dtype.

Every quantizer stores 16 bits as passthrough, so this store is not registered under a quantizer
name; the runtime builds it directly for a 16-bit stream.
"""

from __future__ import annotations

import torch

from polykv.operators import KVStore, WriteCost
from polykv.adapters.quantizers.storage import (check_chunk, check_index, check_write, gather_tokens, held_bytes,
                                                own_copy)


class PassthroughStore(KVStore):
    """One unquantized stream of one layer: [B, Hkv, T, d] in ``dtype`` on ``device``.

    Appends are O(chunk): each appended chunk is kept as its own tensor and the chunks are
    concatenated lazily, on the next :meth:`dequantize` or :meth:`gather`. Nothing is
    over-allocated, so :meth:`resident_bytes` is exactly ``B * Hkv * T * d * dtype_bytes``.

    Parameters
    ----------
    dtype : torch.dtype
        Storage dtype (the model's compute dtype: float32 on CPU tests, bfloat16/float16 on GPU).
    device : torch.device or str
        Where the tensors live; appended chunks are moved here.
    """

    bits = 16

    def __init__(self, *, dtype: torch.dtype, device: torch.device | str):
        self.dtype = dtype
        self.device = torch.device(device)
        self._chunks: list[torch.Tensor] = []
        self._shape: tuple[int, int, int] | None = None  # (B, Hkv, d)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, x: torch.Tensor) -> None:
        """Append ``x`` [B, Hkv, t, d] (copied, converted to the store's dtype and device)."""
        self._shape = check_chunk(x, self._shape, "passthrough store")
        if x.shape[2]:
            self._chunks.append(own_copy(x, dtype=self.dtype, device=self.device))
            self._len += x.shape[2]

    def _data(self) -> torch.Tensor:
        """The stored tokens as one tensor [B, Hkv, T, d] (concatenates pending chunks once)."""
        if self._shape is None:
            raise ValueError("passthrough store is empty: append tokens before reading it")
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=2)]
        if not self._chunks:
            B, H, d = self._shape
            return torch.empty(B, H, 0, d, dtype=self.dtype, device=self.device)
        return self._chunks[0]

    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] in ``dtype``. The stored tensor itself: treat it as read-only."""
        return self._data()

    def token_blocks(self):
        """The stored tensor as a token-blocks view (a ``PackedStream`` with no codes; no copy)."""
        from polykv.adapters.quantizers.packed_stream import PackedStream

        return PackedStream(layout="none", residual=self._data())

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index`` [B, Hkv, k] (strictly ascending, logical storage order)."""
        data = self._data()
        index = check_index(index.to(data.device), self._shape, self._len, "passthrough store")
        kept = gather_tokens(data, index)
        self._chunks = [kept] if kept.shape[2] else []
        self._len = kept.shape[2]

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> WriteCost:
        """Overwrite the tokens where ``mask`` [B, Hkv, T] is True with ``x`` [B, Hkv, T, d] (nothing to requantize)."""
        data = self._data()
        check_write(mask, x, data.shape, "passthrough store")
        self._chunks = [torch.where(mask.unsqueeze(-1), x.to(self.dtype), data)] if self._len else []
        return WriteCost(tokens_written=int(mask.sum()))

    def split_heads(self) -> list["PassthroughStore"]:
        """One store per (batch row, KV head), row-major, holding that head's tokens (copies)."""
        data = self._data()
        out = []
        for b in range(data.shape[0]):
            for h in range(data.shape[1]):
                s = PassthroughStore(dtype=self.dtype, device=self.device)
                s.append(data[b:b + 1, h:h + 1])
                out.append(s)
        return out

    def resident_bytes(self) -> int:
        return held_bytes(*self._chunks)


def passthrough_bytes(*, batch: int, kv_heads: int, head_dim: int, tokens: int, dtype_bytes: int) -> int:
    """Resident bytes of a :class:`PassthroughStore` holding ``tokens`` tokens."""
    return batch * kv_heads * tokens * head_dim * dtype_bytes
