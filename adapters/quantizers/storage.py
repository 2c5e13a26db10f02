"""Shared store checks and the exact byte count (re-exported from :mod:`polykv.store_checks`)."""

from polykv.store_checks import (check_chunk, check_index, check_write, gather_tokens, held_bytes,  # noqa: F401
                                 own_copy)
