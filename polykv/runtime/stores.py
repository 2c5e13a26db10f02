"""Key and value stores of one layer, built from the plan layer's quantizer and bit widths."""

from __future__ import annotations

import torch

from polykv.operators import KVStore
from polykv.plan import PASSTHROUGH_BITS, LayerPlan


def new_store(registry, lp: LayerPlan, stream: str, *, dtype: torch.dtype, device: torch.device) -> KVStore:
    """An empty store for ``stream`` ("key" or "value") of plan layer ``lp``.

    Widths below 16 come from the layer's quantizer
    (``registry.quantizer(lp.quantizer)(**lp.quantizer_params).new_store(...)``); 16 bits is the
    passthrough store, which keeps tensors in the compute dtype.
    """
    bits = lp.k_bits if stream == "key" else lp.v_bits
    if bits == PASSTHROUGH_BITS:
        return passthrough_store(dtype=dtype, device=device)
    quantizer = registry.quantizer(lp.quantizer)(**lp.quantizer_params)
    return quantizer.new_store(stream, bits, dtype=dtype, device=device)


def passthrough_store(*, dtype: torch.dtype, device: torch.device) -> KVStore:
    """The 16-bit store: unquantized tensors in the compute dtype."""
    from polykv.adapters.quantizers.passthrough import PassthroughStore

    return PassthroughStore(dtype=dtype, device=device)
