"""The storage a quantizer's store builds on: what a quantizer plugin imports (as ``polykv.contract.storage``).

- :class:`TokenBuffer` — a preallocated buffer of token rows a store fills (append, gather, reserve);
- :class:`PassthroughStore` and :func:`passthrough_bytes` — the 16-bit store, for a stream left unquantized;
- :class:`WriteCost` — what a store's ``write`` returns; :data:`UNQUANTIZED_BITS` (16, the passthrough width) and
  :data:`QUANTIZED_BITS` (8, 4, 2);
- :class:`TokenRows` — the token-blocks view attention reads (full-precision rows; a quantizer's view
  subclasses it with its codes) and :func:`check_lengths`, the per-head lengths a decode kernel accepts;
- :func:`grown_capacity` — how many rows a growing buffer reserves next (the runtime's reserve policy);
- :func:`check_chunk`, :func:`check_index`, :func:`check_write` — the shape checks of a store's inputs, one line
  naming the store; :func:`gather_tokens`, :func:`held_bytes` and :func:`own_copy` — gathering token rows,
  counting bytes held, copying an input the store keeps.

The definitions live in :mod:`polykv.storage` (the runtime's own stores use them too),
:mod:`polykv.attention.online_softmax` and :mod:`polykv.contract.stores`.
"""

from polykv.attention.online_softmax import check_lengths
from polykv.contract.stores import QUANTIZED_BITS, UNQUANTIZED_BITS, WriteCost
from polykv.storage.token_blocks import TokenRows
from polykv.storage.token_buffer import (PassthroughStore, TokenBuffer, check_chunk, check_index, check_write,
                                         gather_tokens, grown_capacity, held_bytes, own_copy, passthrough_bytes)

__all__ = ["UNQUANTIZED_BITS", "QUANTIZED_BITS", "TokenBuffer", "PassthroughStore", "passthrough_bytes", "WriteCost",
           "TokenRows", "check_lengths", "grown_capacity", "check_chunk", "check_index", "check_write",
           "gather_tokens", "held_bytes", "own_copy"]
