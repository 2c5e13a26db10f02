"""16-bit storage: keys or values kept unquantized (re-exported from :mod:`polykv.runtime.buffer`).

Every quantizer stores 16 bits as passthrough, so this store is not registered under a quantizer
name; the runtime builds it directly for a 16-bit stream.
"""

from polykv.runtime.buffer import PassthroughStore, passthrough_bytes  # noqa: F401
