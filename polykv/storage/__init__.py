"""How a layer's tokens are held: building blocks for the runtime's stores and for quantizer plugins.

- :mod:`polykv.storage.token_buffer` — a preallocated token buffer and the 16-bit passthrough store, the reserve
  policy (how many token rows a store preallocates), the shape checks of a store's inputs and the exact byte count;
- :mod:`polykv.storage.token_blocks` — the token-blocks view of a stored stream that attention reads a
  block at a time (full-precision rows; a quantizer's view adds its codes).

- :mod:`polykv.storage.store` — the store base (:class:`~polykv.storage.store.KVStore`), what a write cost,
  the bit widths.

A bottom layer below the plugin contract: it imports nothing of the contract (which offers these building
blocks to quantizer plugins) and never the runtime. Import the modules themselves (this package re-exports
nothing).
"""
