"""Cross-layer sharing (MiniCache, Liu et al., arXiv 2405.14366): one stream of two adjacent layers stored
as shared directions, per-token magnitudes per layer, and the tokens whose directions disagree kept as they are.

For each token of a pair (lower layer ``l - 1``, upper layer ``l``) with vectors ``x_lo``, ``x_hi`` [d]:
``u = x / max(||x||, eps)``, ``cos = clamp(u_lo . u_hi, -1 + eps, 1 - eps)``, ``Omega = arccos(cos)``,
``e = [sin((1 - t) Omega) u_lo + sin(t Omega) u_hi] / sin Omega`` (the lerp ``(1 - t) u_lo + t u_hi`` when
``|sin Omega| <= eps``), renormalised; each layer restores ``x^ = max(||x||, eps) * e / ||e||``. The tokens with
the largest angular distance ``Omega / pi``, ``ceil(retention_ratio * T)`` per (batch row, KV head), are kept
unmerged in both layers (restored exactly). This is the formula of KVCache-Factory's ``pyramidkv/minicache.py``
(``compress_minicache_pair`` / ``restore_minicache_pair``), with ``t = 0.6`` and ratio 0.05 as its defaults; the
paper's threshold rule (``Omega / pi > d_min + (d_max - d_min) * gamma``) keeps a count per head that is not
known in advance and is not offered.

What is stored (:class:`SharedPair`, shapes B batch, H KV heads, T tokens, R retained, M = T - R merged):
the directions of the merged tokens [B, H, M, d] once, the magnitudes [B, H, M] of each layer, each layer's
retained tokens [B, H, R, d] and their indices [B, H, R] (int64). The merged tokens are the complement of
the retained ones, in token order. The merge runs in float32 (or float64 for float64 inputs) and is stored in
the store's dtype. :class:`SharedStore` is one layer's view of a pair as a :class:`~polykv.contract.stores.KVStore`:
the restored prompt followed by the layer's own decode tokens, appended unmerged.
"""

from __future__ import annotations

import math

import attrs
import torch

from polykv.storage.store import KVStore
from polykv.errors import RuntimeConfigError
from polykv.storage.token_buffer import TokenBuffer, held_bytes

DEFAULT_INTERPOLATION = 0.6
"""MiniCache's ``t`` (the reference code's default; the xKV command line uses 0.5)."""
DEFAULT_RETENTION_RATIO = 0.05
"""Share of each head's tokens kept unmerged: the top ``ceil(0.05 T)`` by angular distance."""
EPS = 1e-6
"""The reference code's ``eps``: magnitude floor, cosine clamp, lerp switch."""
SHARE_PARAMS = {"interpolation": DEFAULT_INTERPOLATION, "retention_ratio": DEFAULT_RETENTION_RATIO}
"""The merge's parameters and their defaults."""


def retained_count(tokens: int, retention_ratio: float = DEFAULT_RETENTION_RATIO) -> int:
    """Tokens per head kept unmerged: ``min(T, ceil(T * ratio))`` (known before the prompt is seen)."""
    return min(int(tokens), math.ceil(int(tokens) * float(retention_ratio)))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def shared_directions(lower: torch.Tensor, upper: torch.Tensor, *, interpolation: float = DEFAULT_INTERPOLATION,
                      eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SLERP of the two layers' unit vectors.

    Parameters
    ----------
    lower, upper : torch.Tensor
        [B, H, T, d] the stream of layer ``l - 1`` and of layer ``l``.

    Returns
    -------
    (direction [B, H, T, d] unit, lower magnitude [B, H, T], upper magnitude [B, H, T], angle [B, H, T]),
    in the work dtype (float32, or float64 for float64 inputs).
    """
    work = _work_dtype(lower)
    lo, hi = lower.to(work), upper.to(work)
    n_lo = lo.norm(dim=-1, keepdim=True).clamp_min(eps)                        # (B, H, T, 1)
    n_hi = hi.norm(dim=-1, keepdim=True).clamp_min(eps)
    u_lo, u_hi = lo / n_lo, hi / n_hi
    cos = (u_lo * u_hi).sum(-1, keepdim=True).clamp(-1.0 + eps, 1.0 - eps)
    angle = torch.acos(cos)
    sin = torch.sin(angle)
    slerp = (torch.sin((1.0 - interpolation) * angle) / sin) * u_lo + (torch.sin(interpolation * angle) / sin) * u_hi
    lerp = (1.0 - interpolation) * u_lo + interpolation * u_hi
    e = torch.where(sin.abs() > eps, slerp, lerp)
    e = e / e.norm(dim=-1, keepdim=True).clamp_min(eps)
    return e, n_lo.squeeze(-1), n_hi.squeeze(-1), angle.squeeze(-1)


def retained_index(angle: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H, count] int64, ascending: the ``count`` tokens of largest angle per (batch row, head)."""
    if count == 0:
        return torch.empty(*angle.shape[:2], 0, dtype=torch.long, device=angle.device)
    return torch.topk(angle, k=count, dim=-1).indices.sort(dim=-1).values


@attrs.define(frozen=True, eq=False)
class SharedPair:
    """One stream of a layer pair, merged (see the module docstring for the shapes)."""

    direction: torch.Tensor
    """[B, H, M, d] unit directions of the merged tokens, in token order (stored once for both layers)."""
    norms: tuple[torch.Tensor, torch.Tensor]
    """([B, H, M], [B, H, M]) magnitudes of the merged tokens in the lower and the upper layer."""
    retained: tuple[torch.Tensor, torch.Tensor]
    """([B, H, R, d], [B, H, R, d]) the unmerged tokens of the lower and the upper layer."""
    index: torch.Tensor
    """[B, H, R] int64 ascending: which tokens are retained."""
    eps: float = EPS

    @property
    def tokens(self) -> int:
        return int(self.direction.shape[2] + self.index.shape[2])

    def merged_mask(self) -> torch.Tensor:
        """[B, H, T] bool, True on merged tokens."""
        B, H, R = self.index.shape
        mask = torch.ones(B, H, self.tokens, dtype=torch.bool, device=self.index.device)
        return mask.scatter(-1, self.index, False)

    def restore(self, side: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, H, T, d] the stream of the lower (``side`` 0) or upper (1) layer as restored, in ``dtype``
        (default: the stored dtype)."""
        e = self.direction.to(_work_dtype(self.direction))
        e = e / e.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        merged = e * self.norms[side].to(e.dtype).unsqueeze(-1)                      # (B, H, M, d)
        B, H, M, d = merged.shape
        out = merged.new_empty(B, H, self.tokens, d)
        out[self.merged_mask()] = merged.reshape(-1, d)
        keep = self.retained[side]
        if keep.shape[2]:
            out.scatter_(2, self.index.unsqueeze(-1).expand(*self.index.shape, d), keep.to(out.dtype))
        return out.to(dtype or self.direction.dtype)

    def side_bytes(self, side: int) -> int:
        """Bytes a layer of the pair holds: its magnitudes and retained tokens; the lower layer (side 0) also the
        shared directions. The retained indices are metadata (:meth:`index_bytes`)."""
        own = held_bytes(self.norms[side], self.retained[side])
        return own + (held_bytes(self.direction) if side == 0 else 0)

    def index_bytes(self) -> int:
        return held_bytes(self.index)


def merge_pair(lower: torch.Tensor, upper: torch.Tensor, *, interpolation: float = DEFAULT_INTERPOLATION,
               retention_ratio: float = DEFAULT_RETENTION_RATIO, dtype: torch.dtype | None = None,
               eps: float = EPS) -> SharedPair:
    """Merge one stream [B, H, T, d] of layers ``l - 1`` (``lower``) and ``l`` (``upper``); store it in ``dtype``
    (default: the inputs' dtype)."""
    if lower.shape != upper.shape or lower.dim() != 4:
        raise ValueError(f"a shared pair needs two [B, H, T, d] streams of one shape, got {tuple(lower.shape)} and "
                         f"{tuple(upper.shape)}")
    dtype = dtype or lower.dtype
    e, n_lo, n_hi, angle = shared_directions(lower, upper, interpolation=interpolation, eps=eps)
    B, H, T, d = lower.shape
    index = retained_index(angle, retained_count(T, retention_ratio))
    R = index.shape[-1]
    mask = torch.ones(B, H, T, dtype=torch.bool, device=lower.device).scatter(-1, index, False)
    at = index.unsqueeze(-1).expand(B, H, R, d)
    return SharedPair(direction=e[mask].view(B, H, T - R, d).to(dtype).contiguous(),
                      norms=(n_lo[mask].view(B, H, T - R).to(dtype).contiguous(),
                             n_hi[mask].view(B, H, T - R).to(dtype).contiguous()),
                      retained=(lower.gather(2, at).to(dtype).contiguous(), upper.gather(2, at).to(dtype).contiguous()),
                      index=index.contiguous(), eps=eps)


def shared_pair_bytes(*, batch: int, kv_heads: int, head_dim: int, tokens: int, retention_ratio: float,
                      dtype_bytes: int, side: int) -> int:
    """Bytes :meth:`SharedPair.side_bytes` holds for a ``tokens``-token prompt (the memory model's count)."""
    R = retained_count(tokens, retention_ratio)
    M = tokens - R
    per_head = M + R * head_dim + (M * head_dim if side == 0 else 0)
    return batch * kv_heads * per_head * dtype_bytes


class SharedStore(KVStore):
    """One layer's stream of a :class:`SharedPair`: the restored prompt, then the layer's decode tokens stored
    unmerged in a :class:`~polykv.storage.token_buffer.TokenBuffer` (grown in blocks, nothing reserved).

    A shared layer keeps every token (no eviction, no merge writes): :meth:`gather` and :meth:`write` refuse."""

    def __init__(self, pair: SharedPair, side: int, *, compute_dtype: torch.dtype, held_dtype: torch.dtype,
                 device: torch.device | str):
        self.pair, self.side, self.compute_dtype = pair, side, compute_dtype
        self.tail = TokenBuffer(dtype=held_dtype, device=device)

    def append(self, x: torch.Tensor) -> None:
        self.tail.append(x.to(self.tail.dtype))

    def gather(self, index: torch.Tensor) -> None:
        raise RuntimeConfigError("a shared layer pair keeps every token: its stores cannot evict (give both layers "
                                 "of the pair rule 'full', or remove 'share')")

    def write(self, mask: torch.Tensor, x: torch.Tensor):
        raise RuntimeConfigError("a shared layer pair's stores take no merge writes (remove 'share' to merge tokens)")

    def dequantize(self) -> torch.Tensor:
        prompt = self.pair.restore(self.side, self.compute_dtype)                   # (B, H, T, d)
        if not self.tail.length:
            return prompt
        return torch.cat([prompt, self.tail.view().to(self.compute_dtype)], dim=2)

    def __len__(self) -> int:
        return self.pair.tokens + self.tail.length

    def resident_bytes(self) -> int:
        return self.pair.side_bytes(self.side) + self.tail.nbytes()
