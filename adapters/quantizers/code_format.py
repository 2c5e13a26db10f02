"""KIVI's code format: asymmetric min-max groups (arXiv 2402.02750), bit-packed into uint8.

**Min-max groups.** For a group with minimum ``mn`` and maximum ``mx``:
``scale = (mx - mn) / (2**b - 1)``, ``q = clamp(round((x - mn) / scale), 0, 2**b - 1)``,
``x' = q * scale + mn``. Scales and minima are stored in the compute dtype; codes are computed
against the *stored* (rounded) scale and minimum, so dequantization is consistent with them.
A constant group has scale 0 and dequantizes to its exact value.

**Packing.** Codes of ``bits`` in {2, 4, 8} are packed ``8 // bits`` to a byte, little-endian inside the
byte: element ``j`` of a group of ``8 // bits`` occupies bits ``[j * bits, (j + 1) * bits)``. Packing runs
along the channel dimension so that every token owns whole bytes: gathering tokens never touches
another token's codes.

**Layouts.** Keys are grouped per channel over G consecutive tokens (``"channel"``: ``scale``/``zero``
[B, H, Ng, d], one row per group, ``group_ids`` [B, H, Tq] or None for token i in row i // G); values per
token over G consecutive channels (``"token"``: ``scale``/``zero`` [B, H, Tq, d / G]). :func:`decode_rows`
reads both, for the stores' ``dequantize`` and the token-blocks view alike.
"""

from __future__ import annotations

import torch

from polykv.contract import storage

PACKABLE_BITS = tuple(sorted(storage.QUANTIZED_BITS))
"""The widths that pack into whole bytes: every quantized width."""


# -- packing ------------------------------------------------------------------------------------------

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


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [..., n] uint8 in ``[0, 2**bits)`` along the last dim (``n`` a multiple of ``8 // bits``):
    [..., n * bits / 8] uint8."""
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
    fields = packed.unsqueeze(-1) >> torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    fields &= (1 << bits) - 1
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


# -- min-max groups -----------------------------------------------------------------------------------

def group_params(mn: torch.Tensor, mx: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) of groups with minimum ``mn`` and maximum ``mx`` (any shape), stored in ``dtype``."""
    scale = (mx - mn) / float((1 << bits) - 1)
    return scale.to(dtype), mn.to(dtype)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``x`` given broadcastable ``scale`` and ``zero`` (group minimum); math in float32."""
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x.float() - zero.float()) / safe)
    return q.clamp_(0, (1 << bits) - 1).to(torch.uint8)


def quantize_groups(x: torch.Tensor, grouped: tuple[int, ...], dim: int, bits: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [B, H, n, d] in the groups that dimension ``dim`` of its view ``grouped`` spans (keys: G
    tokens of a channel, values: G channels of a token): (packed codes [B, H, n, d * bits / 8], scale, zero),
    the scale and minimum with ``dim`` reduced away, in ``dtype``."""
    g = x.float().reshape(grouped)
    scale, zero = group_params(g.amin(dim), g.amax(dim), bits, dtype)
    q = encode(g, scale.unsqueeze(dim), zero.unsqueeze(dim), bits).reshape(x.shape)
    return pack(q, bits), scale, zero


def decode_into(out: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                grouped: tuple[int, ...]) -> torch.Tensor:
    """Dequantize packed codes [B, H, n, d * bits / 8] into ``out`` [B, H, n, d] (the compute dtype, may be a
    slice of a larger tensor): ``codes * scale + zero``, computed in float32; ``scale`` and ``zero`` broadcast
    against ``out.view(grouped)``, a view that exposes the groups (e.g. [B, H, n / G, G, d] for keys).

    A separate multiply and add (two IEEE-rounded steps, never a fused multiply-add) make the
    result independent of broadcasting and kernel choice, so a survivor dequantizes to the same
    bits before and after a gather.
    """
    x = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    unpack_into(x, packed, bits)
    g = x.view(grouped)
    g.mul_(scale.float())
    g.add_(zero.float())
    return out if x is out else out.copy_(x)


def decode_rows(out: torch.Tensor, layout: str, bits: int, group_size: int, codes: torch.Tensor,
                scale: torch.Tensor, zero: torch.Tensor, group_ids: torch.Tensor | None, start: int) -> torch.Tensor:
    """Dequantize code rows ``start .. start + n - 1`` of a ``layout`` stream into ``out`` [B, H, n, d].

    ``codes``, ``scale``, ``zero`` and ``group_ids`` are the whole stream's (see the module docstring); only
    the rows of the span are read. Every read of the codes goes through here, so a token dequantizes to
    the same bits whichever read asks.
    """
    B, H, n, d = out.shape
    G, stop = group_size, start + n
    codes = codes[:, :, start:stop]
    if layout == "token":  # per token: (B, H, n, d / G) rows, G channels each
        return decode_into(out, codes, bits, scale[:, :, start:stop].unsqueeze(-1),
                           zero[:, :, start:stop].unsqueeze(-1), (B, H, n, d // G, G))
    if group_ids is None and start % G == 0 and n % G == 0:  # whole groups: broadcast each row
        rows = slice(start // G, stop // G)
        return decode_into(out, codes, bits, scale[:, :, rows].unsqueeze(3), zero[:, :, rows].unsqueeze(3),
                           (B, H, n // G, G, d))
    if group_ids is None:  # implicit groups: token i uses row i // G
        rows = torch.arange(start, stop, device=out.device) // G
        scale, zero = scale[:, :, rows], zero[:, :, rows]
    else:
        ids = group_ids[:, :, start:stop].long()
        scale, zero = storage.gather_tokens(scale, ids), storage.gather_tokens(zero, ids)
    return decode_into(out, codes, bits, scale, zero, (B, H, n, d))
