"""The bytes model of a plan: nominal bytes (MoE-nD), exact resident bytes, metadata, ratios.

Two numbers per layer, for a context of ``T`` tokens:

* **nominal** bytes, MoE-nD's formula (arXiv 2604.17695):
  ``m_l = keep_l * T * Hkv * d * (k_bits_l + v_bits_l) / 8`` with ``keep_l * T = min(capacity_l, T)``
  whole tokens (a ratio capacity resolves with :meth:`polykv.OpSpec.resolve_capacity`). Scales,
  minima and full-precision residuals are not counted; this is what solvers budget against.
* **resident** bytes: exactly what the runtime's stores hold, via each quantizer's
  ``predict_reserved_bytes`` (16-bit streams: their preallocated buffers, ``C * Hkv * d * dtype_bytes``
  per batch row for the ``C`` token rows :mod:`polykv.storage.token_buffer` reserves). Metadata the runtime keeps
  beside the stores is reported separately.

Which op bounds storage (``phase=``):

* ``"prefill"``: right after prefill, the layer holds ``min(prefill capacity, T)`` tokens. Resident
  bytes are exact for this phase: the runtime selects on the full-precision prompt and appends only
  the survivors, so the quantizer stores see no eviction.
* ``"decode"``: an upper bound on what the stores hold after any decode forward. A decode op
  that evicts fires when storage exceeds ``capacity + decode_slack`` and cuts back to ``capacity``,
  so a layer holds at most ``min(capacity + slack, prefill kept + new_tokens)`` tokens; eviction
  gathers survivors out of quantized groups, so the bytes are the quantizer's ``bound_reserved_bytes``
  (or ``bound_bytes``: the worst store layout of that many tokens after any appends and gathers, with
  the stores asked to reserve ``capacity + slack + 1`` tokens after each eviction: KIVI keys keep one
  scale and minimum row per surviving group and int32 group ids, KIVI keys and values keep up to a
  full residual block in the compute dtype). With a ``full`` decode op nothing is evicted: the layer
  holds ``prefill kept + k`` tokens after k generated tokens (``k <= new_tokens``), appended
  without eviction, and the bytes are the largest ``predict_reserved_bytes`` over that range (exact
  states of stores that reserved what prefill kept).
  ``new_tokens=None`` bounds an unlimited generation for absolute decode capacities; a ratio
  capacity grows with the tokens seen and a ``full`` decode op with every token, so for those the
  bound holds for ``new_tokens`` generated tokens (None counts as 0: the start of decoding).

Window-bounded layers (sliding-window or chunked attention, see
:meth:`polykv.models.geometry.ModelGeometry.token_bound`) never hold more than their bound ``window - 1``,
whatever the plan says: kept tokens are ``min(plan's kept, bound)``, and their ``full_bytes`` (the
uncompressed baseline) is what vanilla transformers holds there, ``min(T, bound)`` tokens. The bound
is known when the geometry is a :class:`~polykv.models.geometry.ModelGeometry`; a plan's own ``model``
record carries no layer types, so pass the geometry for models with such layers.

Metadata right after prefill (the runtime keeps only the decode rule's state): positions int64
``[B, Hkv, C]`` (the reserved rows); then the decode rule's state (:meth:`RetentionRule.new_state`), predicted by
:meth:`RuleState.predict_bytes` and reported under its ``metadata_name``: ``accumulated``
(H2O's float32 ``[B, Hkv, kept]``), ``query_window`` (``[B, H, w, d]`` in the compute dtype plus
int64 positions ``[w]``, ``w = min(window, T)``), ``rule_state`` (any other state). The window
needs the number of query heads: from the geometry (a :class:`polykv.models.geometry.ModelGeometry`) or
``num_heads=``; without it the window is reported as not counted.

Ragged layers (a head-wise rule keeps a different number of tokens per KV head) hold, per head,
exactly that head's tokens: given the per-head counts the runtime reports (``head_counts=``, from
``cache.head_counts()``), the prediction is exact per head; without them it assumes the layer's
budget spread evenly. Layers of an allocation group get their budget at run time: given the
allocations (``allocations=``, from ``session.allocations()``) the prediction is exact; without
them each such row reports the allocator's bound (:meth:`Allocator.bound`) and is marked ``bound``.
"""

from polykv.memory.budgets import (
                                   context_note,
                                   full_cache_bytes_16bit,
                                   held_bytes_per_layer,
                                   layer_held_bytes,
                                   )
from polykv.memory.report import MemoryReport, memory_report
from polykv.memory.resident import MemoryRow, predict_resident, stream_bound_bytes
from polykv.memory.tokens import MEMORY_PHASES, decode_held_tokens, kept_tokens, layer_bounds, nominal_bytes

__all__ = [
    "MEMORY_PHASES",
    "MemoryReport",
    "MemoryRow",
    "context_note",
    "decode_held_tokens",
    "full_cache_bytes_16bit",
    "held_bytes_per_layer",
    "kept_tokens",
    "layer_bounds",
    "layer_held_bytes",
    "memory_report",
    "nominal_bytes",
    "predict_resident",
    "stream_bound_bytes",
]
