"""Key and value stores of one layer, built from the plan layer's quantizer and bit widths."""

from __future__ import annotations

import torch

from polykv.contract.stores import KVStore
from polykv.plan import PASSTHROUGH_BITS, LayerPlan
from polykv.storage.token_buffer import PassthroughStore


def new_store(registry, lp: LayerPlan, stream: str, *, dtype: torch.dtype, device: torch.device,
              storage_dtype: torch.dtype | None = None) -> KVStore:
    """An empty store for ``stream`` ("key" or "value") of plan layer ``lp``.

    Widths below 16 come from the layer's quantizer
    (``registry.quantizer(lp.quantizer)(**lp.quantizer_params).new_store(...)``); 16 bits is the
    passthrough store, which keeps tensors in the compute dtype. ``storage_dtype`` (e.g. bfloat16
    while the model computes in float32) is the dtype the store keeps unquantized tensors, scales
    and residuals in; reads come back in the compute ``dtype``.
    """
    held = dtype if storage_dtype is None else storage_dtype
    bits = lp.k_bits if stream == "key" else lp.v_bits
    if bits == PASSTHROUGH_BITS:
        store = passthrough_store(dtype=held, device=device)
    else:
        quantizer = registry.quantizer(lp.quantizer)(**lp.quantizer_params)
        store = quantizer.new_store(stream, bits, dtype=held, device=device)
    return store if held == dtype else StorageCast(store, dtype)


def passthrough_store(*, dtype: torch.dtype, device: torch.device) -> KVStore:
    """The 16-bit store: unquantized tensors in the compute dtype."""
    return PassthroughStore(dtype=dtype, device=device)


class StorageCast(KVStore):
    """A store kept in a storage dtype whose reads come back in the compute dtype."""

    def __init__(self, inner: KVStore, compute_dtype: torch.dtype):
        self.inner, self.compute_dtype = inner, compute_dtype

    def append(self, x: torch.Tensor) -> None:
        self.inner.append(x)

    def gather(self, index: torch.Tensor) -> None:
        self.inner.gather(index)

    def reserve(self, tokens: int) -> None:
        self.inner.reserve(tokens)

    def write(self, mask: torch.Tensor, x: torch.Tensor):
        return self.inner.write(mask, x)

    def split_heads(self) -> list[KVStore]:
        return [StorageCast(s, self.compute_dtype) for s in self.inner.split_heads()]

    def dequantize(self) -> torch.Tensor:
        return self.inner.dequantize().to(self.compute_dtype)

    def __len__(self) -> int:
        return len(self.inner)

    def resident_bytes(self) -> int:
        return self.inner.resident_bytes()
