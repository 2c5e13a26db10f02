"""Softmax attention rows of a forward, in query chunks, and the signals rule states read from them.

The bottom of the signal machinery, shared by rule states (:mod:`polykv.contract.state`), calibration
and the runtime: :func:`attention_probabilities` yields the rows of the q new queries over their K
keys a chunk at a time (no T x T matrix), and the helpers sum or slice them. A state names what it
reads in ``needs`` (:data:`NEEDS`); :func:`signal_request` unions a layer's declarations into a
:class:`SignalRequest`, and an attention pass that computed them hands them over as
:class:`AttentionSignals`: :func:`attention_with_signals` is that pass, the attention output and
every requested signal from the same probabilities, so no state recomputes them (the runtime's
attention function calls it when a layer's states read this forward's attention).

Shapes: B batch, H query heads, Hkv KV heads, G = H // Hkv, q new queries (the last q of the K
keys they attend), d head dim. The G query heads of a KV head are folded into the query-row axis:
keys are never repeated.
"""

from __future__ import annotations

import math
from typing import Iterator

import attrs
import torch

_CHUNK_ELEMENTS = 1 << 21
"""Float32 logits per query chunk (8 MiB)."""


def lower_right_causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool mask: the q new queries are the last q of the k keys (True = may attend)."""
    rows = torch.arange(q, device=device).unsqueeze(1) + (k - q)
    return torch.arange(k, device=device).unsqueeze(0) <= rows


def chunk_rows(prefix: int, budget_rows: int, remaining: int) -> int:
    """Rows n with n * (prefix + n) <= budget_rows (at least 1, at most ``remaining``)."""
    n = int((-prefix + math.sqrt(prefix * prefix + 4.0 * budget_rows)) / 2)
    return max(1, min(remaining, n))


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, scaling: float,
                            valid: torch.Tensor | None = None, *, positions: tuple | None = None,
                            visible: torch.Tensor | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None, eager: bool = False,
                            dtype: torch.dtype = torch.float32, prefix: bool = False,
                            chunk_elements: int = _CHUNK_ELEMENTS) -> Iterator[tuple[int, torch.Tensor]]:
    """Softmax attention of the q new queries over ``key``, one query chunk at a time.

    The one place polykv turns attention logits into probabilities; no T x T matrix is formed.

    Parameters
    ----------
    query : [B, H, q, d]
        Post-RoPE queries.
    key : [B, Hkv, K, d]
        Keys they attend, unrepeated: the G = H // Hkv query heads of a KV head are folded into
        the query-row axis.
    valid : [B, Hkv, K] bool, optional
        False on padding columns of a ragged layer; they get probability 0.
    positions : (query_positions [q], key_positions [B, Hkv, K]), optional
        Causal by original positions: a query sees the keys at positions <= its own; key position
        -1 marks padding. Without ``positions`` or ``visible`` the q queries are the last q of the
        K keys in storage order (lower-right causal).
    visible : [q, K] or [B, Hkv, q, K] bool, optional
        Which keys each query may see (True), replacing causality: a sliding window or chunk, or a
        recorded mask.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` before masking (Gemma 2).
    sinks : [H], optional
        One extra logit per query head joins every softmax and is then dropped (gpt-oss).
    eager : bool
        Compute as transformers' eager kernels do: logits in the query's dtype, scaled after the
        product, softmax in float32 (in the logits' dtype with sinks). Otherwise the queries are scaled and the logits and softmax are in ``dtype``.
    dtype : torch.dtype
        Logits and softmax dtype when not ``eager`` (float32 unless the caller works wider).
    prefix : bool
        Lower-right causal only: a chunk's rows attend just the keys they can see (the prefix up to
        the chunk's last own key), so the yielded rows are ``K - q + stop`` keys wide, and chunks
        are sized so that ``rows * prefix`` fits ``chunk_elements / (B * H)``.
    chunk_elements : int
        Logits per query chunk.

    Yields
    ------
    (start, probs) with probs [B, Hkv, G, c, K'] for query rows ``start .. start + c`` (K' = K, or
    the chunk's prefix with ``prefix``), float32 or ``dtype``.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    if prefix and (visible is not None or positions is not None):
        raise ValueError("attention_probabilities: prefix chunks need lower-right causality in storage order; "
                         "drop prefix=True when passing visible or positions")
    work = query.dtype if eager else dtype
    kt = key.to(work).transpose(-1, -2)                                       # (B, Hkv, d, K)
    pad = None if valid is None else ~valid.view(B, Hkv, 1, 1, K)
    sink = None if sinks is None else sinks.view(1, Hkv, G, 1, 1)
    if positions is not None:
        qpos = positions[0].to(positions[1].device).view(1, 1, 1, q, 1)
        kpos = positions[1].view(B, Hkv, 1, 1, K)
    start = 0
    while start < q:
        if prefix:
            stop = start + chunk_rows(K - q + start, max(1, chunk_elements // (B * H)), q - start)
            width = K - q + stop                                               # keys these rows may see
        else:
            stop = min(q, start + max(1, chunk_elements // max(1, B * H * K)))
            width = K
        c = stop - start
        # (B, Hkv, G*c, d) rows against (B, Hkv, d, width) keys; a single chunk (a decode step) takes no copies.
        if c == q:
            rows = query.reshape(B, Hkv, G * q, d)
        else:
            rows = query.view(B, Hkv, G, q, d)[:, :, :, start:stop].reshape(B, Hkv, G * c, d)
        keys = kt if width == K else kt[..., :width]
        if eager:
            logits = torch.matmul(rows, keys).view(B, Hkv, G, c, width) * scaling
        else:
            logits = torch.matmul((rows if rows.dtype == work else rows.to(work)) * scaling, keys)
            logits = logits.view(B, Hkv, G, c, width)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if visible is not None:
            seen = visible[start:stop] if visible.dim() == 2 else visible[:, :, None, start:stop]
            logits.masked_fill_(~seen, float("-inf"))
        elif positions is not None:
            logits.masked_fill_((kpos > qpos[..., start:stop, :]) | (kpos < 0), float("-inf"))
        else:
            after = width - (K - q + start) - 1                                # keys after row `start`'s own
            if after > 0:  # row start + i sees none of the last `after` keys but the first i of them
                later = torch.ones(c, after, dtype=torch.bool, device=key.device).triu_()
                logits[..., width - after:].masked_fill_(later, float("-inf"))
        if pad is not None:
            logits.masked_fill_(pad[..., :width], float("-inf"))
        if sink is not None:
            both = torch.cat([logits, sink.to(logits.dtype).expand(B, Hkv, G, c, 1)], dim=-1)
            both = both - both.max(dim=-1, keepdim=True).values
            probs = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32) if eager else torch.softmax(logits, dim=-1)
        del logits
        yield start, probs
        start = stop


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                      valid: torch.Tensor | None = None, **options) -> torch.Tensor:
    """Attention output [B, H, q, dv] from :func:`attention_probabilities` (same arguments): each
    chunk's probabilities meet the values in the values' dtype as soon as they are computed."""
    B, H, q, _ = query.shape
    Hkv = key.shape[1]
    outs = [torch.matmul(probs.to(value.dtype).flatten(2, 3), value[:, :, :probs.shape[-1]])   # (B, Hkv, G*c, dv)
            .view(B, Hkv, H // Hkv, probs.shape[3], -1)
            for _, probs in attention_probabilities(query, key, scaling, valid, **options)]
    return torch.cat(outs, dim=3).reshape(B, H, q, -1)


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
ATTENTION_INPUT = "attention_input"
"""[B, q, D]: the hidden states entering the layer's attention module (what its q/k/v projections read) for the
forward's q new tokens; the runtime captures them only for layers whose states name it (no attention pass)."""
NEEDS = (COLUMN_SUMS, COLUMN_SUMS_PER_HEAD, LAST_ROWS, ATTENTION_INPUT)


@attrs.define(frozen=True)
class SignalRequest:
    """What the states of one layer need from a forward's attention (the union of their ``needs``)."""

    column_sums: bool = False
    column_sums_per_head: bool = False
    last_rows: int = 0
    """Rows of the newest queries (0 = none)."""
    attention_input: bool = False
    """Whether some state reads the attention input (captured before attention, not by it: not in ``bool``)."""

    def __bool__(self) -> bool:
        return self.column_sums or self.column_sums_per_head or self.last_rows > 0

    @property
    def needs_every_row(self) -> bool:
        """True when every query row contributes (column sums): worth computing attention in one pass."""
        return self.column_sums or self.column_sums_per_head


def signal_request(states) -> SignalRequest:
    """The union of what ``states`` (RuleStates or None; composites searched) declare in ``needs``."""
    col = per_head = hidden = False
    rows = 0
    for st in states:
        for leaf in ([] if st is None else st.leaves()):
            needs = frozenset(getattr(leaf, "needs", ()))
            unknown = needs - set(NEEDS)
            if unknown:
                raise ValueError(f"{type(leaf).__name__}.needs names {sorted(unknown)}; known: {list(NEEDS)}")
            col |= COLUMN_SUMS in needs
            per_head |= COLUMN_SUMS_PER_HEAD in needs
            hidden |= ATTENTION_INPUT in needs
            if LAST_ROWS in needs:
                rows = max(rows, int(getattr(leaf, "needed_rows", 0)))
    return SignalRequest(col, per_head, rows, hidden)


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


# -- attention and signals in one pass (the runtime's attention function calls it) ----------------
SIGNAL_CHUNK_ELEMENTS = 1 << 19
"""Float32 logits per query chunk of :func:`attention_with_signals` (2 MiB, so a chunk's logits and
probabilities stay in cache; 8 MiB chunks were measurably slower on CPU)."""


def attention_with_signals(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                           request: SignalRequest, valid: torch.Tensor | None = None, *,
                           chunk_elements: int = SIGNAL_CHUNK_ELEMENTS) -> tuple[torch.Tensor, AttentionSignals]:
    """Softmax attention of the last q positions over K keys, and the signals ``request`` asks for.

    Parameters
    ----------
    query : [B, H, q, d]
        Post-RoPE queries of the q new tokens (the last q of the keys; lower-right causal).
    key, value : [B, Hkv, K, d]
        Every key and value they attend, unrepeated, the new ones last.
    scaling : float
        Attention scaling.
    request : SignalRequest
        Which signals to collect (:func:`polykv.attention.signals.signal_request` of the layer's states).
    valid : [B, Hkv, K] bool, optional
        False on padding columns of a ragged layer (never attended, probability 0).
    chunk_elements : int
        Float32 logits per query chunk.

    Returns
    -------
    (out [B, H, q, dv] in the query's dtype, :class:`~polykv.attention.signals.AttentionSignals`) with
    ``column_sums`` [B, Hkv, K], ``column_sums_per_head`` [B, H, K], ``last_rows`` [B, H, r, K]
    (r = min(request.last_rows, q)) float32, each None unless requested.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    if H % Hkv or K < q:
        raise ValueError(f"attention of {q} queries over {K} keys with {H} query heads and {Hkv} KV heads: the keys "
                         f"must include the queries' own and the heads must group evenly")
    G, dv = H // Hkv, value.shape[-1]
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if q == 1:
        return _one_query(query, key, value, scaling, request, valid, work)
    device = query.device
    out = torch.empty(B, Hkv, G, q, dv, dtype=query.dtype, device=device)
    cols = torch.zeros(B, Hkv, K, dtype=torch.float32, device=device) if request.column_sums else None
    per_head = torch.zeros(B, Hkv, G, K, dtype=torch.float32, device=device) if request.column_sums_per_head else None
    r = min(int(request.last_rows), q)
    rows = torch.zeros(B, Hkv, G, r, K, dtype=torch.float32, device=device) if r else None
    # Each chunk of queries attends only the causal prefix of the keys it may see (K - q + its last row).
    for start, probs in attention_probabilities(query, key, scaling, valid, dtype=work, prefix=True,
                                                chunk_elements=chunk_elements):
        n, prefix = probs.shape[3], probs.shape[4]                           # (B, Hkv, G, n, prefix)
        stop = start + n
        out[:, :, :, start:stop] = torch.matmul(probs.to(value.dtype).view(B, Hkv, G * n, prefix),
                                                value[:, :, :prefix]).view(B, Hkv, G, n, dv)
        if cols is not None:
            cols[..., :prefix] += probs.sum(dim=(2, 3))
        if per_head is not None:
            per_head[..., :prefix] += probs.sum(dim=3)
        if rows is not None and stop > q - r:
            first = max(start, q - r)
            slots = slice(first - (q - r), stop - (q - r))                  # this chunk's own newest rows
            rows[:, :, :, slots, :prefix] = probs[:, :, :, first - start:]
        del probs
    signals = AttentionSignals(
        column_sums=cols,
        column_sums_per_head=None if per_head is None else per_head.view(B, H, K),
        last_rows=None if rows is None else rows.view(B, H, r, K))
    return out.view(B, H, q, dv), signals


def _one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               request: SignalRequest, valid: torch.Tensor | None, work: torch.dtype
               ) -> tuple[torch.Tensor, AttentionSignals]:
    """:func:`attention_with_signals` for a decode step (q = 1): the same products as the chunked loop's
    single chunk, without its bookkeeping; every signal is a view or a sum of the one probability row."""
    B, H = query.shape[:2]
    K = key.shape[2]
    # One chunk: its probabilities are [B, Hkv, G, 1, K], the G heads of a KV head its rows.
    _, probs = next(attention_probabilities(query, key, scaling, valid, dtype=work))
    probs = probs.squeeze(3)                                                  # (B, Hkv, G, K)
    out = torch.matmul(probs.to(value.dtype), value).to(query.dtype).view(B, H, 1, -1)
    return out, AttentionSignals(
        column_sums=probs.sum(dim=2) if request.column_sums else None,
        column_sums_per_head=probs.view(B, H, K) if request.column_sums_per_head else None,
        last_rows=probs.view(B, H, 1, K) if request.last_rows > 0 else None)
