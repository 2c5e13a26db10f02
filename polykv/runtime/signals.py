"""Selection signals a layer keeps for its retention rules: recent queries and accumulated attention.

Only what some rule of the layer declared is tracked (:class:`SignalNeeds`). Everything here is
computed row by row or in query chunks: no T x T score matrix is ever materialised.

Shapes: B batch, H query heads, Hkv key/value heads, G = H // Hkv, q new queries of one forward,
K keys attended by them (stored + new), d head dim, w kept query window.
"""

from __future__ import annotations

from typing import Iterable

import attrs
import torch

from polykv.operators import SIGNAL_ACCUMULATED

_CHUNK_ELEMENTS = 1 << 21
"""Float32 logits per query chunk of the column sums (8 MiB)."""


@attrs.define(frozen=True)
class SignalNeeds:
    """What a set of rules needs: how many recent queries, and whether accumulated attention."""

    window: int = 0
    accumulated: bool = False

    @classmethod
    def of(cls, rules: Iterable[tuple[type, dict]]) -> "SignalNeeds":
        """Union of the needs of ``(rule class, params)`` pairs."""
        window, acc = 0, False
        for rule_cls, params in rules:
            window = max(window, int(rule_cls.query_window(params)))
            acc = acc or rule_cls.signal == SIGNAL_ACCUMULATED
        return cls(window=window, accumulated=acc)


def lower_right_causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool mask: the q new queries are the last q of the k keys (True = may attend).

    Every stored token precedes the new ones, so the same mask serves every head whatever each
    head retained.
    """
    rows = torch.arange(q, device=device).unsqueeze(1) + (k - q)
    return torch.arange(k, device=device).unsqueeze(0) <= rows


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of every new query, summed over queries and the G heads of each KV head.

    Parameters
    ----------
    query : [B, H, q, d]
        Post-RoPE queries of the new tokens (the last q of the K keys).
    key : [B, Hkv, K, d]
        Keys they attend (stored + new), post-RoPE, unrepeated.
    scaling : float
        Attention scaling.

    Returns
    -------
    [B, Hkv, K] float32 column sums, computed in query chunks of at most 8 MiB of logits.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    kt = key.float().transpose(-1, -2).unsqueeze(2)                     # (B, Hkv, 1, d, K)
    out = torch.zeros(B, Hkv, K, dtype=torch.float32, device=key.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, B * H * K))
    qg = query.view(B, Hkv, G, q, d)
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        logits = torch.matmul(qg[:, :, :, start:stop].float(), kt) * scaling  # (B, Hkv, G, c, K)
        if q > 1:
            visible = lower_right_causal(q, K, key.device)[start:stop]     # (c, K)
            logits.masked_fill_(~visible, float("-inf"))
        out += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
        del logits
    return out


@attrs.define
class SignalState:
    """Signals of one layer, aligned with the layer's token storage order."""

    needs: SignalNeeds
    queries: torch.Tensor | None = None
    """[B, H, w, d] newest post-RoPE queries (newest last), compute dtype."""
    query_positions: torch.Tensor | None = None
    """[w] int64 positions of ``queries``."""
    accumulated: torch.Tensor | None = None
    """[B, Hkv, T] float32 accumulated attention of each stored token."""

    def observe(self, query: torch.Tensor, key: torch.Tensor, scaling: float, first_position: int) -> None:
        """Record the q new queries of one forward, which attended ``key`` [B, Hkv, K, d].

        ``accumulated`` must cover the K - q tokens stored before this forward (it grows by q).
        """
        q = query.shape[2]
        if self.needs.window:
            pos = torch.arange(first_position, first_position + q, device=query.device)
            w = self.needs.window
            if self.queries is None:
                self.queries, self.query_positions = query[:, :, -w:].clone(), pos[-w:]
            else:
                self.queries = torch.cat([self.queries, query], dim=2)[:, :, -w:].contiguous()
                self.query_positions = torch.cat([self.query_positions, pos])[-w:]
        if self.needs.accumulated:
            K = key.shape[2]
            sums = attention_column_sums(query, key, scaling)
            if self.accumulated is None:
                self.accumulated = sums
            else:
                prev = self.accumulated
                if prev.shape[-1] != K - q:
                    raise AssertionError(f"accumulated attention covers {prev.shape[-1]} tokens, expected {K - q}")
                self.accumulated = torch.nn.functional.pad(prev, (0, q)) + sums

    def gather(self, index: torch.Tensor) -> None:
        """Keep the signals of the tokens ``index`` [B, Hkv, k] (storage order)."""
        if self.accumulated is not None:
            self.accumulated = self.accumulated.gather(-1, index)

    def narrow_to(self, needs: SignalNeeds) -> None:
        """Drop what ``needs`` no longer asks for (after prefill, only the decode rule's needs stay)."""
        self.needs = needs
        if not needs.window:
            self.queries = self.query_positions = None
        elif self.queries is not None:
            self.queries = self.queries[:, :, -needs.window:].contiguous()
            self.query_positions = self.query_positions[-needs.window:]
        if not needs.accumulated:
            self.accumulated = None

    def metadata_bytes(self) -> dict[str, int]:
        """Bytes held: accumulated float32 [B, Hkv, T]; query window [B, H, w, d] + int64 positions [w]."""
        acc = self.accumulated.numel() * 4 if self.accumulated is not None else 0
        win = 0
        if self.queries is not None:
            win = self.queries.numel() * self.queries.element_size() + self.query_positions.numel() * 8
        return {"accumulated": acc, "query_window": win}
