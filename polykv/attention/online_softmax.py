"""Softmax attention over blocks of keys without materialising the cache (online softmax).

Attention of queries over a layer's stored tokens can be computed a block of tokens at a time:
each block is read (dequantized) on its own, its logits are taken against the queries, and a
running maximum ``m``, denominator ``l`` and weighted sum ``acc`` per query row combine the blocks
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the flash-attention
recurrence). After the last block ``acc / l`` equals ``softmax(logits) @ values`` over all tokens.

This module knows nothing about how a stream is stored. A store that can be read this way offers
the *token-blocks* capability: a method ``token_blocks()`` returning an object with

- ``padded_len`` (int): tokens per head in the padded layout (the longest head);
- ``lengths`` ([B, Hkv] int64 tensor, or None when every head holds ``padded_len`` tokens): the
  valid tokens of each head; a head's tokens are its first ``lengths`` positions, the rest is
  padding that is never attended (its content is never read into a softmax);
- ``read(start, stop)`` -> [B, Hkv, stop - start, d]: tokens ``start .. stop - 1`` of every head in
  the compute dtype (padding positions may hold anything);
- optionally ``fused_kernel()`` and ``fused_ready(query)``: a fused kernel for the same attention,
  ``kernel(query, keys, values, scaling=...)`` with the view as the keys or the values, and whether it runs
  for ``query`` (e.g. a quantizer's Triton kernel on a CUDA query).

:func:`token_blocks` discovers the capability; :func:`blockwise_attention` is the layout-independent
reference (the CPU path and the oracle of every fused kernel).

Shapes: B batch, H query heads, Hkv key/value heads, G = H // Hkv, q new queries (the last q
tokens of every head), d head dim. GQA keys are never repeated: the G query heads of a KV head are
folded into the query-row axis (row ``g * q + i`` is query ``i`` of head ``kv * G + g``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

DEFAULT_BLOCK = 1024
"""Tokens per block of :func:`blockwise_attention`."""


class TokenBlocks(Protocol):
    """A stream of one layer readable a block of tokens at a time (see the module docstring)."""

    padded_len: int
    lengths: torch.Tensor | None

    def read(self, start: int, stop: int) -> torch.Tensor: ...


def token_blocks(store) -> TokenBlocks | None:
    """The store's token-blocks view, or None when the store does not offer one."""
    method = getattr(store, "token_blocks", None)
    return None if method is None else method()


class OnlineSoftmax:
    """Running softmax state of ``rows`` query rows: maximum, denominator and weighted value sum.

    Not a form of :func:`polykv.attention.signals.attention_probabilities`: the blocks here never
    become probabilities (each is exponentiated against a running maximum and folded into the
    value sum), so no block's softmax is ever normalised on its own.

    Parameters
    ----------
    shape : tuple of int
        Leading shape of the rows, e.g. (B, Hkv, G * q).
    dim : int
        Value head dim.
    device : torch.device
        Where the float32 state lives.
    """

    def __init__(self, shape: tuple[int, ...], dim: int, device: torch.device):
        self.m = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
        self.l = torch.zeros(shape, dtype=torch.float32, device=device)
        self.acc = torch.zeros(*shape, dim, dtype=torch.float32, device=device)

    def add(self, logits: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in one block: ``logits`` [..., rows, n] float32 (-inf = not visible), ``values`` [..., n, dv]."""
        m_new = torch.maximum(self.m, logits.amax(-1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp() stays 0, not nan.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - shift)
        p = torch.exp(logits - shift.unsqueeze(-1))  # (..., rows, n); exactly 0 where logits == -inf
        self.l = self.l * alpha + p.sum(-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.matmul(p, values.float())
        self.m = m_new

    def merge(self, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> None:
        """Fold in a partial result over other tokens (m, l [..., rows], acc [..., rows, dv])."""
        m_new = torch.maximum(self.m, m)
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        a, b = torch.exp(self.m - shift), torch.exp(m - shift)
        self.l = self.l * a + l * b
        self.acc = self.acc * a.unsqueeze(-1) + acc * b.unsqueeze(-1)
        self.m = m_new

    def result(self) -> torch.Tensor:
        """``acc / l`` [..., rows, dv] float32; every row must have seen at least one visible key."""
        if bool((self.l == 0).any()):
            raise ValueError("online softmax: a query row saw no visible key (a head holds fewer tokens than the "
                             "queries it must attend to)")
        return self.acc / self.l.unsqueeze(-1)


def combine_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, dim: int) -> torch.Tensor:
    """Combine partial results over disjoint token sets stacked along ``dim``: [..., rows, dv] float32.

    ``m`` and ``l`` [..., S, ..., rows] are each part's running maximum and denominator (m = -inf,
    l = 0 for a part that saw no visible key); ``acc`` [..., rows, dv] its unnormalised value sum.
    A row that no part saw comes out nan.
    """
    top = m.amax(dim, keepdim=True)
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - shift)  # 0 for parts that saw nothing
    total = (l * w).sum(dim)
    # No host check here (this runs after every fused decode step): a row no part saw comes out nan;
    # check_lengths() rules that out before a kernel runs.
    return (acc * w.unsqueeze(-1)).sum(dim) / total.unsqueeze(-1)


def visible(q: int, group: int, start: int, stop: int, lengths: torch.Tensor | None, padded_len: int,
            device: torch.device) -> torch.Tensor | None:
    """Which tokens ``start .. stop - 1`` each query row may see: [B or 1, Hkv or 1, G*q, n] bool, or None (all).

    The q queries are the last q tokens of every head, so query ``i`` sees token ``j`` iff
    ``j <= L - q + i`` with ``L`` the head's length (lower-right causal); this also hides padding.
    """
    if lengths is None and stop - 1 <= padded_len - q:
        return None  # every column is visible to every row
    cols = torch.arange(start, stop, device=device)
    rows = torch.arange(q, device=device).repeat(group)  # (G*q,): query index i of row g*q + i
    if lengths is None:
        limit = rows + (padded_len - q)  # (G*q,)
        return (cols.view(1, -1) <= limit.view(-1, 1)).view(1, 1, group * q, -1)
    limit = (lengths.to(device) - q).unsqueeze(-1) + rows  # (B, Hkv, G*q)
    return cols.view(1, 1, 1, -1) <= limit.unsqueeze(-1)


def check_lengths(lengths: torch.Tensor | None, shape: tuple[int, int], padded_len: int, q: int) -> None:
    """Per-head lengths must be [B, Hkv] integers in [q, padded_len]: every query needs its own token."""
    if lengths is None:
        if padded_len < q:
            raise ValueError(f"attention over {padded_len} stored tokens with {q} queries: the queries' own tokens "
                             f"must be stored (append them before attending)")
        return
    if tuple(lengths.shape) != tuple(shape) or lengths.is_floating_point():
        raise ValueError(f"per-head lengths must be an integer tensor of shape {tuple(shape)}, got "
                         f"{tuple(lengths.shape)} {lengths.dtype}")
    if lengths.numel() and (int(lengths.min()) < q or int(lengths.max()) > padded_len):
        raise ValueError(f"per-head lengths must lie in [{q}, {padded_len}] (each head stores at least its q new "
                         f"tokens and at most the padded length), got [{int(lengths.min())}, {int(lengths.max())}]")


def blockwise_attention(query: torch.Tensor, keys: TokenBlocks, values: TokenBlocks, *, scaling: float,
                        block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, q, d] over two token-block streams: [B, H, q, dv].

    Reads ``block_size`` tokens of keys and values at a time, takes float32 logits against the
    folded GQA query rows, masks what a row may not see (padding of ragged heads, lower-right
    causality among the q new tokens) and combines the blocks with :class:`OnlineSoftmax`. The
    result is cast to the query's dtype. Keys and values must agree on padded length and lengths.
    """
    B, H, q, d = query.shape
    T, lengths = keys.padded_len, keys.lengths
    if values.padded_len != T:
        raise ValueError(f"keys hold {T} (padded) tokens per head but values hold {values.padded_len}")
    if (lengths is None) != (values.lengths is None) or (
            lengths is not None and not torch.equal(lengths, values.lengths)):
        raise ValueError("keys and values disagree on the per-head lengths; a token must be kept or dropped in both")
    first = keys.read(0, min(block_size, T))
    Hkv = first.shape[1]
    if H % Hkv or first.shape[0] != B:
        raise ValueError(f"query has batch {B} and {H} heads; the stores hold batch {first.shape[0]} and {Hkv} KV "
                         f"heads (query heads must be a multiple of KV heads)")
    check_lengths(lengths, (B, Hkv), T, q)
    G = H // Hkv
    rows = query.float().reshape(B, Hkv, G * q, d)  # (B, Hkv, G*q, d): no copy of the keys per query head
    if T <= block_size and lengths is None:
        # One block of uniform heads (a decode forward): one SDPA call, the G query heads of a KV head folded
        # into its rows, lower-right causal among several new tokens, in the blocks' dtype when it is the
        # query's: what SDPA over the dequantized layer computes. Otherwise in float32.
        v = values.read(0, T)
        if not (first.dtype == v.dtype == query.dtype):
            first, v = first.float(), v.float()
        seen = visible(q, G, 0, T, None, T, query.device)
        out = F.scaled_dot_product_attention(query.reshape(B, Hkv, G * q, d).to(first.dtype), first, v,
                                             attn_mask=seen, scale=scaling)
        return out.view(B, H, q, -1).to(query.dtype)
    state: OnlineSoftmax | None = None
    for start in range(0, T, block_size):
        stop = min(start + block_size, T)
        k = (first if start == 0 else keys.read(start, stop)).float()  # (B, Hkv, n, d)
        v = values.read(start, stop).float()                            # (B, Hkv, n, dv)
        logits = torch.matmul(rows, k.transpose(-1, -2)) * scaling  # (B, Hkv, G*q, n)
        seen = visible(q, G, start, stop, lengths, T, query.device)
        if seen is not None:
            logits = logits.masked_fill(~seen, float("-inf"))
            # Padding may hold anything (even nan): zero what no row sees so p * v stays finite.
            v = v.masked_fill(~seen.any(-2).unsqueeze(-1), 0.0)
        if state is None:
            state = OnlineSoftmax((B, Hkv, G * q), v.shape[-1], query.device)
        state.add(logits, v)
    out = state.result()  # (B, Hkv, G*q, dv)
    return out.view(B, H, q, -1).to(query.dtype)


def per_head_attention(query: torch.Tensor, heads: list[tuple[TokenBlocks, TokenBlocks]], *, scaling: float,
                       block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Attention when every (batch row, KV head) keeps its own stores: [B, H, q, dv].

    ``heads`` lists B * Hkv (keys, values) token-block pairs, row-major over (batch row, KV head),
    each [1, 1, n, d] holding exactly that head's n tokens (ragged storage that frees what it drops).
    Head (b, h) attends with its G query heads ``h * G .. h * G + G - 1`` over its own pair only.
    """
    return _each_head(query, heads, lambda qh, k, v: blockwise_attention(qh, k, v, scaling=scaling,
                                                                         block_size=block_size))


def _each_head(query: torch.Tensor, heads: list, attend) -> torch.Tensor:
    """``attend(query rows of head (b, h) [1, G, q, d], its keys, its values)`` for each of the B * Hkv
    row-major ``heads`` pairs, joined into [B, H, q, dv]."""
    B, H, q, _ = query.shape
    if not heads or len(heads) % B:
        raise ValueError(f"per-head attention needs batch x KV heads store pairs, got {len(heads)} for batch {B}")
    Hkv = len(heads) // B
    if H % Hkv:
        raise ValueError(f"query has {H} heads, not a multiple of the {Hkv} KV heads the stores hold")
    G = H // Hkv
    outs = [attend(query[i // Hkv:i // Hkv + 1, (i % Hkv) * G:(i % Hkv + 1) * G], k, v)
            for i, (k, v) in enumerate(heads)]
    return torch.cat(outs, dim=1).view(B, H, q, -1)


DECODE_BLOCK = 8192
"""Tokens per block of :func:`decode_attention_from_stores` on the CPU: a decode step has G * q query
rows per KV head, so the float32 block (``DECODE_BLOCK * d * 4`` bytes per head and stream) is the
only transient, and a context up to this length is read in one block."""


def decode_attention_from_stores(query: torch.Tensor, key_store, value_store, *, scaling: float,
                                 block_size: int = DECODE_BLOCK) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over a layer's stores read from their codes: [B, H, q, dv].

    The call a decoding runtime makes for a layer whose stores offer token blocks: the fused kernel the
    key view, else the value view, offers when that view says it runs for this query (``fused_ready(query)``,
    e.g. the Triton kernel of the KIVI stores on a CUDA query with Triton installed); otherwise
    :func:`blockwise_attention` with blocks of ``block_size`` tokens. Nothing dequantizes a whole
    store; a store without token blocks is an error that says so.
    """
    keys, values = _views(key_store, value_store)
    kernel = _fused_kernel(keys, values, query)
    if kernel is not None:
        return kernel(query, keys, values, scaling=scaling)
    return blockwise_attention(query, keys, values, scaling=scaling, block_size=block_size)


def decode_attention_per_head(query: torch.Tensor, heads: list, *, scaling: float) -> torch.Tensor:
    """Attention when every (batch row, KV head) keeps its own key and value store: [B, H, q, dv].

    ``heads`` lists B * Hkv (key_store, value_store) pairs, row-major over (batch row, KV head), each
    [1, 1, n, d] holding exactly that head's n tokens (ragged storage). Head (b, h) attends with its G
    query heads over its own stores through :func:`decode_attention_from_stores`: no head is padded
    to the longest and nothing is masked.
    """
    return _each_head(query, heads, lambda qh, k, v: decode_attention_from_stores(qh, k, v, scaling=scaling))


def _views(key_store, value_store):
    keys, values = token_blocks(key_store), token_blocks(value_store)
    for store, view in ((key_store, keys), (value_store, values)):
        if view is None:
            raise ValueError(f"{type(store).__name__} offers no token blocks (no token_blocks() method): attention "
                             f"cannot read it from its codes; dequantize() it and use SDPA instead")
    return keys, values


def _fused_kernel(keys, values, query: torch.Tensor | None = None):
    """The fused kernel the key view, else the value view, offers (``fused_kernel()``); with ``query``, only
    one its view says runs for that query (``fused_ready(query)``). None when neither offers one."""
    for view in (keys, values):
        offer = getattr(view, "fused_kernel", None)
        if offer is not None and (query is None or view.fused_ready(query)):
            return offer()
    return None


BACKENDS = ("blockwise", "fused")


def attend_stores(query: torch.Tensor, key_store, value_store, *, scaling: float, backend: str = "blockwise",
                  block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over a layer's key and value stores, read from their codes.

    ``backend`` is chosen by the caller, never substituted: ``"blockwise"`` runs
    :func:`blockwise_attention` over the stores' token blocks; ``"fused"`` calls the fused kernel the key
    view, else the value view, offers (e.g. the Triton kernel of the KIVI stores). A store without token
    blocks, or two views without a fused kernel, is an error that says so.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {BACKENDS}")
    keys, values = _views(key_store, value_store)
    if backend == "blockwise":
        return blockwise_attention(query, keys, values, scaling=scaling, block_size=block_size)
    kernel = _fused_kernel(keys, values)
    if kernel is None:
        raise ValueError(f"the token blocks of {type(key_store).__name__} and {type(value_store).__name__} offer no "
                         f"fused kernel; use backend='blockwise'")
    return kernel(query, keys, values, scaling=scaling)
