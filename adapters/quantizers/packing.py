"""Bit packing of small integer codes into uint8, along the last (channel) dimension.

Codes of ``bits`` in {2, 4, 8} are packed ``8 // bits`` to a byte, little-endian inside the byte:
element ``j`` of a group of ``8 // bits`` occupies bits ``[j * bits, (j + 1) * bits)``. Packing runs
along the channel dimension so that every token owns whole bytes: gathering tokens never touches
another token's codes.
"""

from __future__ import annotations

import torch

from polykv.contract import storage

PACKABLE_BITS = tuple(sorted(storage.QUANTIZED_BITS))
"""The widths that pack into whole bytes: every quantized width."""


def per_byte(bits: int) -> int:
    """How many ``bits``-wide codes share one byte."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported widths are {PACKABLE_BITS}")
    return 8 // bits


def packed_width(channels: int, bits: int) -> int:
    """Bytes that ``channels`` codes of ``bits`` take; ``channels`` must fill whole bytes."""
    n = per_byte(bits)
    if channels % n:
        raise ValueError(f"{channels} channels of {bits}-bit codes do not fill whole bytes: the head dim "
                         f"must be a multiple of {n} to store {bits}-bit codes")
    return channels // n


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, device=device, dtype=torch.uint8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last dim.

    Parameters
    ----------
    codes : torch.Tensor
        [..., n] uint8 values in ``[0, 2**bits)``; ``n`` a multiple of ``8 // bits``.
    bits : int
        Code width: 2, 4 or 8.

    Returns
    -------
    torch.Tensor
        [..., n * bits / 8] uint8.
    """
    n = codes.shape[-1]
    width = packed_width(n, bits)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], width, 8 // bits)  # (..., n/k, k)
    out = grouped[..., 0].clone()
    for j in range(1, 8 // bits):  # k <= 4 fields per byte, never a loop over tokens
        out |= grouped[..., j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: [..., m] uint8 -> [..., m * 8 / bits] uint8 codes."""
    if bits == 8:
        return packed
    k = per_byte(bits)
    mask = (1 << bits) - 1
    fields = packed.unsqueeze(-1) >> _shifts(bits, packed.device)  # (..., m, k)
    fields &= mask
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * k)


def unpack_into(dst: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack ``packed`` [..., m] into ``dst`` [..., m * 8 / bits] of any dtype (e.g. float32 directly).

    ``dst`` may be a strided view whose last dim is contiguous. Each of the ``8 // bits`` fields is
    extracted with one shift and mask over the packed bytes and cast while it is written, so no
    uint8 copy of the unpacked codes is made.
    """
    if bits == 8:
        return dst.copy_(packed)
    k = per_byte(bits)
    fields = dst.view(*dst.shape[:-1], packed.shape[-1], k)  # (..., m, k)
    mask = (1 << bits) - 1
    for j in range(k):  # k <= 4 fields per byte, never a loop over tokens
        field = packed >> (j * bits) if j else packed
        fields[..., j].copy_(field & mask if j < k - 1 else field)
    return dst
