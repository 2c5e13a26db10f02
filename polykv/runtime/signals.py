"""Attention and the signals rule states declared, in one pass over causal query chunks.

When some state of a layer needs this forward's attention (``RuleState.needs``: column sums per KV
head or per query head, the newest rows), :func:`attention_with_signals` computes the attention
output itself and collects those signals from the same probabilities, so no state recomputes
them. Query rows run in chunks; a chunk attends only the causal prefix of the keys it may see
(nothing is spent on the masked upper triangle); the G query heads of a KV head are folded into the
row axis, so keys are never repeated; logits and softmax are float32 (a 16-bit model's keys are read
in float32 once per forward), probabilities meet the values in the values' dtype, as transformers'
eager attention does.

The chunked math of the generic path (a state asking for something no pass computed) lives in
:mod:`polykv.attention.signals`, a bottom module shared with calibration; it is re-exported here.

Shapes: B batch, H query heads, Hkv KV heads, G = H // Hkv, q new queries (the last q of the K
keys), d head dim.
"""

from __future__ import annotations

import torch

from polykv.attention.signals import (AttentionSignals, SignalRequest, attention_column_sums, attention_probabilities,
                                      lower_right_causal)

__all__ = ["attention_column_sums", "attention_probabilities", "attention_with_signals", "lower_right_causal",
           "SIGNAL_CHUNK_ELEMENTS"]

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
