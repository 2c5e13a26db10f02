"""Asymmetric min-max quantization of groups (KIVI, arXiv 2402.02750), shared by key and value stores.

For a group with minimum ``mn`` and maximum ``mx``:
``scale = (mx - mn) / (2**b - 1)``, ``q = clamp(round((x - mn) / scale), 0, 2**b - 1)``,
``x' = q * scale + mn``. Scales and minima are stored in the compute dtype; codes are computed
against the *stored* (rounded) scale and minimum, so dequantization is consistent with them.
A constant group has scale 0 and dequantizes to its exact value.
"""

from __future__ import annotations

import torch

from polykv.adapters.quantizers.packing import unpack_into


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


def decode_into(out: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                grouped: tuple[int, ...]) -> torch.Tensor:
    """Dequantize packed codes into ``out``: ``codes * scale + zero``, computed in float32.

    Parameters
    ----------
    out : torch.Tensor
        [B, H, n, d] destination in the compute dtype (may be a slice of a larger tensor).
    packed : torch.Tensor
        [B, H, n, d * bits / 8] uint8 packed codes.
    bits : int
        Code width.
    scale, zero : torch.Tensor
        Broadcastable against ``out.view(grouped)`` (one value per group).
    grouped : tuple of int
        A view of [B, H, n, d] that exposes the groups (e.g. [B, H, n / G, G, d] for keys).

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
