"""Shared checks and the exact byte count used by every KV store (the 16-bit store and the quantizers' stores)."""

from __future__ import annotations

import torch


def held_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what they actually keep alive).

    A view keeps its whole base storage alive, so this counts storages, not elements: a store
    that kept a slice of a larger buffer would show it here.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def own_copy(x: torch.Tensor, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh contiguous copy of ``x`` on ``device`` in ``dtype`` that owns exactly its elements."""
    return x.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)


def check_chunk(x: torch.Tensor, shape: tuple[int, int, int] | None, what: str) -> tuple[int, int, int]:
    """Check that ``x`` is [B, Hkv, t, d] and matches the store's (B, Hkv, d); returns (B, Hkv, d)."""
    if x.dim() != 4:
        raise ValueError(f"{what}: append expects [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
    got = (x.shape[0], x.shape[1], x.shape[3])
    if shape is not None and got != shape:
        raise ValueError(f"{what}: appended chunk has (batch, kv_heads, head_dim) = {got} but the store holds "
                         f"{shape}; use one store per layer and stream")
    if not x.is_floating_point():
        raise ValueError(f"{what}: append expects a floating-point tensor, got {x.dtype}")
    return got


def check_index(index: torch.Tensor, shape: tuple[int, int, int] | None, stored: int, what: str) -> torch.Tensor:
    """Check a gather index [B, Hkv, k]: integer, strictly ascending, inside ``[0, stored)``.

    Returns it as int64. Indices refer to logical storage order (the order of :meth:`dequantize`).
    """
    if shape is None:
        raise ValueError(f"{what}: gather on an empty store; append tokens first")
    B, H, _ = shape
    if index.dim() != 3 or index.shape[0] != B or index.shape[1] != H:
        raise ValueError(f"{what}: gather expects an index of shape [{B}, {H}, k], got {tuple(index.shape)}")
    if index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(f"{what}: gather expects integer indices, got {index.dtype}")
    index = index.to(torch.int64)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= stored:
            raise ValueError(f"{what}: gather index out of range [{lo}, {hi}] for {stored} stored tokens")
        if index.shape[2] > 1 and not bool((index[..., 1:] > index[..., :-1]).all()):
            raise ValueError(f"{what}: gather indices must be strictly ascending along the last dim "
                             f"(sort them, e.g. with torch.sort, and drop duplicates)")
    return index


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, c] at index [B, H, k] along the token dim -> a new [B, H, k, c] tensor."""
    B, H, _, c = x.shape
    return torch.gather(x, 2, index.unsqueeze(-1).expand(B, H, index.shape[2], c))


def check_write(mask: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Check a write: ``mask`` [B, Hkv, T] bool and ``x`` [B, Hkv, T, d] matching the stored [B, Hkv, T, d]."""
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape[:3]):
        raise ValueError(f"{what}: write expects a bool mask of shape {tuple(shape[:3])}, got {tuple(mask.shape)} "
                         f"{mask.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{what}: write expects values of shape {tuple(shape)}, got {tuple(x.shape)}")
