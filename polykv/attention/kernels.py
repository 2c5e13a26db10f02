"""The attention kernels every attention path calls: SDPA with the masks of windows and ragged padding, and
the eager path of logit softcapping and learned sinks; they know no plan, store or cache.

* full attention: every stored token precedes the q new ones, so one lower-right causal [q, K] mask serves
  every head, whatever each head retained (a ragged layer's padding columns, ``valid``, are masked too);
* sliding-window and chunked layers (:data:`polykv.models.geometry.WINDOWED`): the mask is computed from the
  original position of every attended token per head (:func:`window_visibility`), so a query sees exactly
  the tokens of its window or chunk, as in the model's own mask.

Plain softmax attention runs in :func:`torch.nn.functional.scaled_dot_product_attention` (:func:`sdpa`);
logit softcapping (Gemma 2) and learned attention sinks (gpt-oss ``s_aux``) run in :func:`eager_attention`, in
query chunks. GQA keys are never repeated. Shapes: B batch, H query heads, Hkv KV heads (G = H / Hkv), q new
tokens, K attended keys, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polykv.attention.signals import chunked_attention, lower_right_causal
from polykv.models.geometry import CHUNKED

_SDPA_MASK_ELEMENTS = 1 << 22
"""Mask entries per query-row chunk of :func:`sdpa` with a mask (4 Mi: 16 MiB as float32)."""
_EAGER_CHUNK_ELEMENTS = 1 << 22
"""Logits per query chunk of :func:`eager_attention` (16 MiB in float32)."""


def window_visibility(positions: torch.Tensor, first_position: int, q: int, *, window: int | None,
                      attention_type: str, same_rows: bool) -> torch.Tensor | None:
    """Which keys the q new queries of a windowed layer may see; None for a full-attention layer (``window`` None).

    ``positions`` [B, Hkv, K]: the original positions of the K attended keys; ``first_position``: the first new
    query's. Returns [q, K] bool when every head holds the same keys (``same_rows``: a prefill over the raw prompt)
    and [B, Hkv, q, K] otherwise (heads may hold different tokens). ``attention_type`` ``chunked_attention``: a
    query sees its own chunk of ``window`` tokens; else the ``window`` newest positions up to its own.
    """
    if window is None:
        return None
    keys = positions[0, 0] if same_rows else positions
    rows = torch.arange(first_position, first_position + q, device=keys.device).unsqueeze(1)       # (q, 1)
    cols = keys.unsqueeze(-2)                                                                       # (..., 1, K)
    visible = cols <= rows
    if attention_type == CHUNKED:
        return visible & (torch.div(cols, window, rounding_mode="floor")
                          == torch.div(rows, window, rounding_mode="floor"))
    return visible & (cols > rows - window)


def _group_mask(visible: torch.Tensor, G: int, q: int) -> torch.Tensor:
    """[q, K] or [B, Hkv, q, K] visibility -> the (.., G*q, K) mask of G query heads folded per KV head."""
    if visible.dim() == 2:
        return visible.repeat(G, 1)
    B, Hkv, _, K = visible.shape
    return visible.unsqueeze(2).expand(B, Hkv, G, q, K).reshape(B, Hkv, G * q, K)


def _mask(q: int, K: int, device, visible: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor | None:
    """Window visibility ([q, K] or [B, Hkv, q, K]) and/or ragged padding ([B, Hkv, K]) as one bool mask
    (None: plain lower-right causal attention)."""
    if valid is None:
        return visible
    base = lower_right_causal(q, K, device) if visible is None else visible
    return base & valid.unsqueeze(-2)                                              # (B, Hkv, q, K)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
         valid: torch.Tensor | None = None, *, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last q positions over K keys: [B, H, q, d].

    Parameters
    ----------
    query : [B, H, q, d]
    key, value : [B, Hkv, K, d], K >= q, the q new tokens last.
    valid : [B, Hkv, K] bool, optional
        False on the padding columns of a ragged layer (heads holding fewer tokens than the longest,
        padded at the front); those columns are never attended.
    visible : None for lower-right causal attention, else the [q, K] or [B, Hkv, q, K] bool mask of
        :func:`window_visibility` (a sliding-window or chunked layer).
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    mask = _mask(q, K, query.device, visible, valid)
    if mask is not None and q == 1 and bool(mask.all()):
        mask = None  # a decode step that sees every stored token
    if mask is None and q == K:
        # No stored tokens: plain causal attention.
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=G > 1)
    if mask is None and q == 1:
        # One query sees every key: fold the G heads of a group into the query axis, no mask
        # (measured faster on CPU than enable_gqa, and far faster than repeating K/V).
        out = F.scaled_dot_product_attention(query.view(B, Hkv, G, d), key, value, scale=scaling)  # (B, Hkv, G, d)
        return out.view(B, H, 1, -1)
    # Several new tokens after stored ones, a window or padding: fold the G heads of a group into the query axis,
    # in query-row chunks whose mask holds at most _SDPA_MASK_ELEMENTS entries (SDPA turns a bool mask into a
    # float one: a probe chunk of 2k queries over an 8k prompt would otherwise take ~200 MB per layer).
    causal = mask is None
    per_row = G * K * (B * Hkv if mask is not None and mask.dim() == 4 else 1)
    rows = max(1, min(q, _SDPA_MASK_ELEMENTS // per_row))
    out = query.new_empty(B, H, q, value.shape[-1])
    for a in range(0, q, rows):
        b = min(a + rows, q)
        n = b - a
        qg = query[:, :, a:b].reshape(B, Hkv, G * n, d)                           # (B, Hkv, G*n, d)
        if causal:  # rows a..b see the keys up to their own: the first K - q + b
            end = K - q + b
            part = F.scaled_dot_product_attention(qg, key[:, :, :end], value[:, :, :end], scale=scaling,
                                                  attn_mask=_group_mask(lower_right_causal(n, end, query.device), G, n))
        else:
            part = F.scaled_dot_product_attention(qg, key, value, scale=scaling,
                                                  attn_mask=_group_mask(mask[..., a:b, :], G, n))
        out[:, :, a:b] = part.view(B, H, n, -1)
    return out


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    valid: torch.Tensor | None = None, *, visible: torch.Tensor | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with logit softcapping and/or learned sinks, as transformers' eager kernels compute it.

    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` before masking (Gemma 2).
    ``sinks`` [H]: one extra logit per head joins every softmax and is then dropped (gpt-oss).
    Shapes as :func:`sdpa`; queries run in chunks of at most 4 Mi logits.
    """
    return chunked_attention(query, key, value, scaling, valid, visible=visible, softcap=softcap, sinks=sinks,
                             eager=True, chunk_elements=_EAGER_CHUNK_ELEMENTS)
