"""Softmax attention rows of a forward, in query chunks, and the signals rule states read from them.

The bottom of the signal machinery, shared by rule states (:mod:`polykv.contract.state`), calibration
and the runtime: :func:`attention_probabilities` yields the rows of the q new queries over their K
keys a chunk at a time (no T x T matrix), and the helpers sum or slice them. A state names what it
reads in ``needs`` (:data:`NEEDS`); :func:`signal_request` unions a layer's declarations into a
:class:`SignalRequest`, and an attention pass that computed them hands them over as
:class:`AttentionSignals`.

Shapes: B batch, H query heads, Hkv KV heads, G = H // Hkv, q new queries (the last q of the K
keys they attend), d head dim. The G query heads of a KV head are folded into the query-row axis:
keys are never repeated.
"""

from __future__ import annotations

from typing import Iterator

import attrs
import torch

_CHUNK_ELEMENTS = 1 << 21
"""Float32 logits per query chunk (8 MiB)."""


def lower_right_causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool mask: the q new queries are the last q of the k keys (True = may attend)."""
    rows = torch.arange(q, device=device).unsqueeze(1) + (k - q)
    return torch.arange(k, device=device).unsqueeze(0) <= rows


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, scaling: float,
                            valid: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Softmax attention of the q new queries over ``key``, one query chunk at a time.

    Parameters
    ----------
    query : [B, H, q, d]
        Post-RoPE queries of the new tokens (the last q of the K keys).
    key : [B, Hkv, K, d]
        Keys they attend (stored + new), unrepeated.
    valid : [B, Hkv, K] bool, optional
        False on padding columns of a ragged layer; they get probability 0.

    Yields
    ------
    (start, probs) with probs [B, Hkv, G, c, K] float32 for query rows ``start .. start + c``.
    The G query heads of a KV head are folded into the query-row axis: keys are never repeated.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    kt = key.float().transpose(-1, -2)                                      # (B, Hkv, d, K)
    rows = max(1, _CHUNK_ELEMENTS // max(1, B * H * K))
    qg = query.view(B, Hkv, G, q, d)
    pad = None if valid is None else ~valid.view(B, Hkv, 1, K)
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        c = stop - start
        chunk = qg[:, :, :, start:stop].float().reshape(B, Hkv, G * c, d) * scaling
        logits = torch.matmul(chunk, kt).view(B, Hkv, G, c, K)              # (B, Hkv, G, c, K)
        after = q - start - 1                                               # keys after row `start`'s own
        if after > 0:  # row start + i sees none of the last `after` keys but the first i of them
            later = torch.ones(c, after, dtype=torch.bool, device=key.device).triu_()
            logits[..., K - after:].masked_fill_(later, float("-inf"))
        if pad is not None:
            logits.masked_fill_(pad.unsqueeze(2), float("-inf"))
        yield start, torch.softmax(logits, dim=-1)
        del logits


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of every new query summed over queries and the G heads of each KV head.

    Returns [B, Hkv, K] float32 (see :func:`attention_probabilities` for the arguments).
    """
    B, Hkv, K = key.shape[0], key.shape[1], key.shape[2]
    out = torch.zeros(B, Hkv, K, dtype=torch.float32, device=key.device)
    for _, probs in attention_probabilities(query, key, scaling, valid):
        out += probs.sum(dim=(2, 3))
    return out


def attention_column_sums_per_head(query: torch.Tensor, key: torch.Tensor, scaling: float,
                                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of every new query summed over queries, per query head: [B, H, K] float32."""
    B, H, K = key.shape[0], query.shape[1], key.shape[2]
    out = torch.zeros(B, H, K, dtype=torch.float32, device=key.device)
    for _, probs in attention_probabilities(query, key, scaling, valid):
        out += probs.sum(dim=3).reshape(B, H, K)
    return out


def attention_last_rows(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention rows of the last ``rows`` new queries over ``key``: [B, H, rows, K] float32.

    Query ``i`` of the q new ones sees the keys up to its own (lower-right causal) and no padding.
    """
    B, H, q, d = query.shape
    rows = min(int(rows), q)
    Hkv, K = key.shape[1], key.shape[2]
    # The last `rows` queries are the last `rows` of the keys too: the same causal offset.
    out = [p for _, p in attention_probabilities(query[:, :, q - rows:], key, scaling, valid)]
    return torch.cat(out, dim=3).reshape(B, H, rows, K)


# -- what a state needs from the attention pass ------------------------------------------------------

COLUMN_SUMS = "column_sums"
"""[B, Hkv, K]: this forward's attention summed over its queries and the G heads of each KV head."""
COLUMN_SUMS_PER_HEAD = "column_sums_per_head"
"""[B, H, K]: this forward's attention summed over its queries, per query head."""
LAST_ROWS = "last_rows"
"""[B, H, r, K]: the attention rows of this forward's last r queries (r = the state's ``needed_rows``)."""
NEEDS = (COLUMN_SUMS, COLUMN_SUMS_PER_HEAD, LAST_ROWS)


@attrs.define(frozen=True)
class SignalRequest:
    """What the states of one layer need from a forward's attention (the union of their ``needs``)."""

    column_sums: bool = False
    column_sums_per_head: bool = False
    last_rows: int = 0
    """Rows of the newest queries (0 = none)."""

    def __bool__(self) -> bool:
        return self.column_sums or self.column_sums_per_head or self.last_rows > 0

    @property
    def needs_every_row(self) -> bool:
        """True when every query row contributes (column sums): worth computing attention in one pass."""
        return self.column_sums or self.column_sums_per_head


def signal_request(states) -> SignalRequest:
    """The union of what ``states`` (RuleStates or None; composites searched) declare in ``needs``."""
    col = per_head = False
    rows = 0
    for st in states:
        for leaf in ([] if st is None else st.leaves()):
            needs = frozenset(getattr(leaf, "needs", ()))
            unknown = needs - set(NEEDS)
            if unknown:
                raise ValueError(f"{type(leaf).__name__}.needs names {sorted(unknown)}; known: {list(NEEDS)}")
            col |= COLUMN_SUMS in needs
            per_head |= COLUMN_SUMS_PER_HEAD in needs
            if LAST_ROWS in needs:
                rows = max(rows, int(getattr(leaf, "needed_rows", 0)))
    return SignalRequest(col, per_head, rows)


@attrs.define(frozen=True, kw_only=True)
class AttentionSignals:
    """What an attention pass computed besides its output, float32 (None: not computed).

    Every tensor describes the forward's K attended keys (stored + new, storage order).
    """

    column_sums: torch.Tensor | None = None
    """[B, Hkv, K] (:data:`COLUMN_SUMS`)."""
    column_sums_per_head: torch.Tensor | None = None
    """[B, H, K] (:data:`COLUMN_SUMS_PER_HEAD`)."""
    last_rows: torch.Tensor | None = None
    """[B, H, r, K] rows of the last r queries (:data:`LAST_ROWS`)."""
