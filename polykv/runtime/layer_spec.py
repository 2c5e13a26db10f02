"""What a layer cache is built from and what one forward through it carries: records, no behaviour.

:class:`LayerSpec` (one per plan layer, resolved once when the session is built,
:func:`polykv.runtime.session.layer_spec`: its rule objects, its quantizer, its window, its bases, whether its
attention is a plain softmax), :class:`CacheSettings` (what every layer of one cache reads from the session) and
:class:`ForwardStep` (one forward through one layer, from :meth:`~polykv.runtime.layer_cache.LayerCache.begin`
through attention (:func:`polykv.runtime.layer_cache.serve`) to
:meth:`~polykv.runtime.layer_cache.LayerCache.after_attention`).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from polykv.attention.low_rank import LowRank
from polykv.models.geometry import FULL
from polykv.plan import PASSTHROUGH_BITS, LayerPlan
from polykv.runtime.plugin_results import StoreContract, StreamSpec
from polykv.runtime.storage import LayerStorage, StorageView


@attrs.define(frozen=True, kw_only=True)
class LayerSpec:
    """Everything a layer cache needs from the session, resolved once per plan layer
    (:func:`polykv.runtime.session.layer_spec`)."""

    plan: LayerPlan
    prefill_rule: Any = None
    """Rule object of the prefill op, or None for ``full``."""
    decode_rule: Any = None
    """Rule object of the decode op, or None for ``full``."""
    quantizer: Any = None
    """The plan layer's quantizer object (its stores and their checks are built from it), or None when both
    streams are kept at 16 bits."""
    attention_type: str = FULL
    """The model's attention type of this layer (``full_attention``, ``sliding_attention``, ``chunked_attention``)."""
    window: int | None = None
    """Sliding window or chunk size of a windowed layer (None for full attention)."""
    token_bound: int | None = None
    """Most tokens per head the layer keeps whatever the plan says (``window - 1``; None = unbounded)."""
    low_rank: LowRank | None = None
    """The layer's bases (CPU float32) when the plan gives it a rank: keys and values are stored, scored and
    attended as codes; None: full width."""
    plain: bool = True
    """Whether the model's attention here is a plain softmax (no logit softcap, no sinks), as :func:`polykv.apply`
    found on the attention module: only then may a decode forward read straight from the stores."""

    def store_contract(self, *, storage_dtype: torch.dtype | None, full: bool) -> StoreContract:
        """The checks of this layer's stores (:class:`~polykv.runtime.plugin_results.StoreContract`); a layer cache
        builds them for a quantized layer, or for any layer with the expensive checks on (``full``)."""
        lp = self.plan
        streams = {stream: StreamSpec(None, bits) if bits == PASSTHROUGH_BITS
                   else StreamSpec(lp.quantizer, bits, self.quantizer)
                   for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))}
        return StoreContract(layer_idx=lp.layer, streams=streams, storage_dtype=storage_dtype, full=full)


@attrs.define(frozen=True, kw_only=True, eq=False)
class CacheSettings:
    """What every layer of one cache reads from the session, passed to each :class:`LayerCache` at construction."""

    decode_slack: int
    """Tokens a head may exceed its decode capacity by before the decode rule evicts (the plan's trigger)."""
    storage_dtype: torch.dtype | None = None
    """dtype the stores keep K/V, scales and residuals in (None: the compute dtype)."""
    check: bool = False
    """Run the expensive plugin contract checks (:mod:`polykv.runtime.plugin_results`)."""
    rope_inv_freq: torch.Tensor | None = None
    """[d/2] the model's RoPE inverse frequencies (for rules that undo or redo RoPE), or None."""
    rope_scaling: float = 1.0
    """The model's RoPE attention scaling."""
    model_data: Mapping[str, Any] = attrs.field(factory=dict)
    """Per-model data the plan's rules read (``apply(model_data=...)``)."""
    generator: torch.Generator | None = None
    """The generator of sampling rules (seeded once per cache)."""
    attention_inputs: dict = attrs.field(factory=dict)
    """``layer -> [B, q, D]`` hidden states entering the attention module of the layers whose states read them,
    kept by the session's pre-hooks (:class:`~polykv.attention.attach.AttentionInputs`); each step pops its own."""


@attrs.define(frozen=True, kw_only=True, eq=False)
class ForwardStep:
    """One forward through one layer: what :meth:`LayerCache.begin` made ready for attention, and what
    :meth:`LayerCache.after_attention` finishes. K is the number of keys attended (stored + q new; during
    prefill the whole prompt so far)."""

    layer_idx: int
    phase: str
    """``"prefill"`` (the prompt is not stored yet), ``"decode"`` or ``"probe"``."""
    view: StorageView
    """The keys [B, Hkv, K, d] and values to attend (the model gets them from ``update``), their original
    positions [B, Hkv, K] and the padding mask ``valid`` [B, Hkv, K] of a ragged layer (None: no padding).
    When :attr:`stores` is set it holds only the q new keys and values, and no positions."""
    stores: LayerStorage | None
    """The layer's storage when this forward attends straight from its stores (no dense view built)."""
    first_position: int
    """Position of the first new token: tokens seen before this forward."""
    states: tuple
    """The rule (and allocator) states that observe this forward (empty: nothing observes it)."""
    ends_prompt: bool
    """Prefill: whether the prompt is complete after this forward (the prefill rule selects then)."""
    attention_type: str
    """The layer's attention type (``full_attention``, ``sliding_attention``, ``chunked_attention``)."""
    window: int | None
    """Sliding window or chunk size (None for full attention); the attention's mask reads it."""
    probe: Any = None
    """The :class:`~polykv.contract.probe.ProbeChunk` of a probe forward (phase ``"probe"``: it attends the
    unselected prompt and its own keys, which are discarded after it), else None."""

    @property
    def keys(self) -> torch.Tensor:
        return self.view.keys

    @property
    def values(self) -> torch.Tensor:
        return self.view.values

    @property
    def positions(self) -> torch.Tensor | None:
        return self.view.positions

    @property
    def valid(self) -> torch.Tensor | None:
        return self.view.valid
