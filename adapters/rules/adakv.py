"""Ada-KV: head-wise budgets inside a layer, around any scored rule (SnapKV by default).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", arXiv:2407.11550. Reference code: https://github.com/FFY0/AdaKV
(``adaptive_snapkv/monkeypatch/snapkv_utils.py``, ``AdaptiveSnapKVCluster.update_kv``).

Shapes: B batch, Hkv KV heads, T stored tokens, n = T - protected candidate tokens per head.

The inner rule scores every token per KV head and protects its first / last tokens (SnapKV: the
observation window). With C the layer capacity and ``Bavg = C - protected`` the average number of
candidates a head keeps, Ada-KV ranks the candidates of all Hkv heads together, takes the global top
``Hkv * Bavg``, and counts ``c_h``, how many of them fall in head h. Head h then keeps its own top

    B_h = round((1 - alpha) * c_h + floor(alpha * Bavg))

candidates plus the protected tokens (:func:`head_budgets`), so kept counts differ per head and the
storage is ragged.
"""

from __future__ import annotations

import math

import torch


def head_budgets(scores: torch.Tensor, average: int, *, floor_alpha: float = 0.2,
                 rounding: str = "exact") -> torch.Tensor:
    """Candidates each KV head keeps: [B, Hkv] int64.

    Parameters
    ----------
    scores : [B, Hkv, n]
        Candidate scores per KV head (higher = keep); protected tokens excluded.
    average : int
        Average candidates per head, ``0 <= average <= n``.
    floor_alpha : float
        Share of ``average`` every head gets regardless of scores (reference ``floor_alpha``).
    rounding : {"exact", "reference"}
        ``"reference"`` rounds each head half-to-even as the reference does, so the layer total can
        drift from ``Hkv * average`` by a few tokens. ``"exact"`` rounds by largest remainders
        (ties to the lower head index) so the total is exactly ``Hkv * average``.
    """
    B, Hkv, n = scores.shape
    if not 0 <= average <= n:
        raise ValueError(f"rule 'adakv': average head budget {average} must lie in [0, {n}]")
    if not 0.0 <= floor_alpha <= 1.0:
        raise ValueError(f"rule 'adakv': floor_alpha must lie in [0, 1], got {floor_alpha}")
    flat = scores.float().reshape(B, Hkv * n)
    # The tie-breaker of top_k_sorted: earlier (head, token) wins among equal scores.
    order = torch.arange(Hkv * n, device=scores.device, dtype=torch.float64)
    winners = torch.topk(flat.double() - order * 1e-12, Hkv * average, dim=-1).indices // n   # (B, Hkv*avg)
    won = torch.zeros(B, Hkv, dtype=torch.int64, device=scores.device)
    won.scatter_add_(-1, winners, torch.ones_like(winners))
    floor_cap = math.floor(average * floor_alpha + 1e-9)
    raw = won.double() * (1.0 - floor_alpha) + floor_cap                                     # (B, Hkv)
    if rounding == "reference":
        return torch.round(raw).to(torch.int64).clamp(0, n)
    if rounding != "exact":
        raise ValueError(f"rule 'adakv': rounding must be 'exact' or 'reference', got {rounding!r}")
    base = torch.floor(raw + 1e-9).to(torch.int64)
    short = Hkv * average - base.sum(dim=-1)                                                  # (B,)
    frac = raw - base.double()
    rank = torch.argsort(torch.argsort(-(frac - torch.arange(Hkv, device=raw.device) * 1e-9), dim=-1), dim=-1)
    return (base + (rank < short.unsqueeze(-1)).to(torch.int64)).clamp(0, n)


def ragged_top(scores: torch.Tensor, counts: torch.Tensor, n_first: int, n_last: int) -> list[list[torch.Tensor]]:
    """Kept indices per (batch row, KV head): the protected tokens plus the head's top ``counts`` candidates.

    ``scores`` [B, Hkv, T]; candidates are ``n_first <= j < T - n_last``; ties keep the earlier
    token. Returns a B x Hkv nested list of ascending int64 index tensors of length
    ``n_first + counts[b, h] + n_last``.
    """
    B, Hkv, T = scores.shape
    cand = scores[..., n_first: T - n_last].double()
    order = torch.arange(cand.shape[-1], device=scores.device, dtype=torch.float64)
    ranked = torch.argsort(cand - order * 1e-12, dim=-1, descending=True, stable=True) + n_first
    first = torch.arange(n_first, device=scores.device)
    last = torch.arange(T - n_last, T, device=scores.device)
    out = []
    for b in range(B):
        row = []
        for h in range(Hkv):
            top = ranked[b, h, : int(counts[b, h])]
            row.append(torch.sort(torch.cat([first, top, last])).values)
        out.append(row)
    return out
