"""The runtime's preallocated token buffers and 16-bit store (defined in :mod:`polykv.storage.token_buffer`, a bottom
module, so that quantizer packages can import the 16-bit store without importing the runtime)."""

from polykv.storage.token_buffer import PassthroughStore, TokenBuffer, passthrough_bytes  # noqa: F401
