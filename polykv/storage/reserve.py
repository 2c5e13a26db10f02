"""How much room a layer's storage reserves: one policy shared by the runtime and the memory model.

A layer's stores and positions live in preallocated buffers of ``C`` token rows per KV head
(``C >=`` the tokens stored). Decode appends write into the free rows; eviction compacts the kept
rows to the front of the same buffers. ``C`` is set in three places, always by these functions:

* when the prompt is stored (``kept`` tokens per head), :func:`reserve_tokens`: a layer that is cut
  back between forwards to at most ``hold`` tokens per head (``capacity + decode_slack`` of an
  evicting decode op, an allocator's budget + slack, a window's bound, the smallest that applies)
  reserves ``min(max(kept, hold), kept + slack) + 1`` rows: room for the decode slack's tokens, never
  more than the layer can hold, so one-token decode forwards reallocate at most once per ``slack``
  tokens and a short prompt reserves no more than its own tokens and the slack (not the capacity);
  a layer that keeps everything reserves exactly ``kept`` rows (right after prefill it holds what
  vanilla holds);
* when an append does not fit, :func:`grown_capacity`: a keep-everything buffer grows by whole blocks
  of :data:`GROWTH_BLOCK` rows counted from its own size (it grows at its first decode token, then is
  copied once every ``GROWTH_BLOCK`` tokens, always holding fewer than ``GROWTH_BLOCK`` spare rows; the
  heads of a ragged layer grow together); a layer that is cut back grows to :func:`reserve_tokens` of
  the tokens it now holds instead (another ``slack`` tokens of room, capped at ``hold + 1``; a ratio
  capacity's ``hold`` moves with the tokens seen);
* after an eviction, the layer asks again for :func:`reserve_tokens` of what it now holds; a store
  whose buffer is larger releases the extra rows (one reallocation; e.g. a decode-only rule after its
  first eviction of the whole prompt), a smaller one grows.

A ragged layer (per-head stores) applies the same policy per head with ``hold = kept_h + slack``
(its own count, not the layer's capacity), so no head is padded to the longest.
"""

from __future__ import annotations

DEFAULT_DECODE_SLACK = 128
"""Tokens a decode op may go past its capacity before it evicts (a plan's ``trigger.decode_slack`` default)."""
GROWTH_BLOCK = 16
"""Token rows a keep-everything buffer grows by (and rounds to)."""


def grown_capacity(tokens: int, base: int = 0) -> int:
    """Rows of a buffer of ``base`` rows that grew, a whole :data:`GROWTH_BLOCK` at a time, to hold
    ``tokens``: ``base + GROWTH_BLOCK * ceil((tokens - base) / GROWTH_BLOCK)`` (``base`` when it
    already holds them). Blocks count from the buffer's own size, not from row 0, so buffers that
    reserved different sizes and then receive the same tokens (the heads of a ragged layer) grow
    together and hold the same spare rows."""
    base, extra = int(base), int(tokens) - int(base)
    return base if extra <= 0 else base + -(-extra // GROWTH_BLOCK) * GROWTH_BLOCK


def reserve_tokens(kept: int, hold: int | None, *, slack: int) -> int:
    """Rows to reserve for ``kept`` stored tokens when the layer is cut back to ``hold`` tokens per head
    after every forward (None: never cut back) and decode appends ``slack`` tokens between evictions:
    ``min(max(kept, hold), kept + slack) + 1``, or exactly ``kept`` when nothing bounds the layer (it
    grows by :func:`grown_capacity` when decoding starts)."""
    if hold is None:
        return int(kept)
    return min(max(int(kept), int(hold)), int(kept) + max(int(slack), 0)) + 1


def cut_back_rows(kept: int, new_tokens: int, hold: int, *, slack: int) -> int:
    """Rows of a cut-back layer's buffer (:func:`reserve_tokens` at ``kept``) after ``new_tokens`` one-token
    appends that did not reach ``hold`` (no eviction yet): each append that does not fit grows the buffer
    to :func:`reserve_tokens` of the tokens then held."""
    rows = reserve_tokens(kept, hold, slack=slack)
    held = int(kept)
    for _ in range(int(new_tokens)):
        held += 1
        if held > rows:
            rows = reserve_tokens(held, hold, slack=slack)
    return rows


def capacity_after(tokens: int, reserved: int) -> int:
    """Rows of a buffer that reserved ``reserved`` rows and then received appends up to ``tokens``."""
    return grown_capacity(tokens, reserved)


def layer_hold(*, capacity: int | None, decode_slack: int, bound: int | None) -> int | None:
    """Most tokens per head a layer keeps between forwards: ``capacity + decode_slack`` when its decode op
    evicts (``capacity`` not None), capped by the window ``bound``; None when neither applies."""
    hold = None if capacity is None else int(capacity) + int(decode_slack)
    if bound is not None:
        hold = int(bound) if hold is None else min(hold, int(bound))
    return hold


def reserved_stream_bytes(quantizer, stream: str, bits: int, *, tokens: int, reserved: int, batch: int, kv_heads: int,
                          head_dim: int, dtype_bytes: int) -> int:
    """Bytes of a fresh store that reserved ``reserved`` tokens and then received ``tokens`` (no eviction):
    a 16-bit store (``quantizer`` None) holds its buffer, ``capacity_after(tokens, reserved)`` rows;
    a quantized one says so in :meth:`polykv.contract.stores.Quantizer.predict_reserved_bytes`."""
    if quantizer is None:
        return batch * kv_heads * capacity_after(tokens, reserved) * head_dim * dtype_bytes
    return int(quantizer.predict_reserved_bytes(stream, bits, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                                                tokens=tokens, reserved=reserved, dtype_bytes=dtype_bytes))
