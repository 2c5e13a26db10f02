"""Attention in a low-rank code space: keys and values stored as codes on orthonormal bases per KV head.

With a key basis ``P`` [d, r_k] and a value basis ``U`` [d, r_v] per KV head (orthonormal columns,
:mod:`polykv.models.kv_bases`), a layer stores per token ``c = P^T k`` and ``e = U^T v`` (written right
after RoPE) and attends without ever rebuilding full-width keys or values::

    logits_j = (P^T q) . c_j * scaling        (scaling = 1/sqrt(d) of the ORIGINAL head dim)
    out      = U (sum_j a_j e_j)              (one r_v x d lift per query head and step)

which equals attention over the reconstructions ``P P^T k`` and ``U U^T v``, and plain attention when
the keys and values lie in the bases' span. Either stream may be kept full width (its basis None).
Shapes: B batch, H query heads, Hkv KV heads (G = H / Hkv), q queries, T tokens, d head dim.
"""

from __future__ import annotations

import torch


class LowRank:
    """The projections of one layer: ``key`` [Hkv, d, r_k] and/or ``value`` [Hkv, d, r_v] (None: full width)."""

    def __init__(self, key: torch.Tensor | None, value: torch.Tensor | None):
        if key is None and value is None:
            raise ValueError("a low-rank layer projects at least one stream")
        self.key, self.value = key, value

    def to(self, device, dtype) -> "LowRank":
        """The same bases on ``device`` in ``dtype``."""
        move = (lambda b: None if b is None else b.to(device=device, dtype=dtype))  # noqa: E731
        return LowRank(move(self.key), move(self.value))

    @staticmethod
    def project(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        """Codes of ``x`` [B, Hkv, T, d] on ``basis`` [Hkv, d, r]: [B, Hkv, T, r] (``x`` itself when None)."""
        return x if basis is None else torch.matmul(x, basis.to(x.dtype))

    def codes(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c [B, Hkv, T, r_k], e [B, Hkv, T, r_v]) of post-RoPE ``keys`` and ``values`` [B, Hkv, T, d]."""
        return self.project(keys, self.key), self.project(values, self.value)

    def queries(self, query: torch.Tensor) -> torch.Tensor:
        """``P^T q`` of ``query`` [B, H, q, d] with each query head on its KV head's basis: [B, H, q, r_k]."""
        if self.key is None:
            return query
        B, H, q, d = query.shape
        Hkv = self.key.shape[0]
        out = torch.matmul(query.reshape(B, Hkv, H // Hkv, q, d), self.key.to(query.dtype).unsqueeze(1))
        return out.reshape(B, H, q, -1)                                            # (B, H, q, r_k)

    def lift(self, out: torch.Tensor) -> torch.Tensor:
        """``U o`` of the attended codes ``out`` [B, H, q, r_v]: [B, H, q, d]."""
        if self.value is None:
            return out
        B, H, q, r = out.shape
        Hkv = self.value.shape[0]
        up = self.value.to(out.dtype).transpose(-1, -2).unsqueeze(1)               # (Hkv, 1, r_v, d)
        return torch.matmul(out.reshape(B, Hkv, H // Hkv, q, r), up).reshape(B, H, q, -1)

    def reconstruct(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P P^T k, U U^T v)`` [B, Hkv, T, d]: what the code-space attention attends (for references)."""
        def back(x, basis):
            if basis is None:
                return x
            b = basis.to(x.dtype)
            return torch.matmul(torch.matmul(x, b), b.transpose(-1, -2))
        return back(keys, self.key), back(values, self.value)
