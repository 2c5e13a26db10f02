"""What a layer cache is built from and what one forward through it carries.

:class:`LayerSpec` (one per plan layer, resolved once by the session), :class:`CacheSettings` (what every layer of
one cache reads from the session), :class:`ForwardStep` (one forward through one layer, from
:meth:`~polykv.runtime.layer_cache.LayerCache.begin` to
:meth:`~polykv.runtime.layer_cache.LayerCache.after_attention`) and :func:`new_rule_states`.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from polykv.models.geometry import FULL, ModelGeometry
from polykv.plan import LayerPlan
from polykv.runtime.storage import LayerStorage, StorageView


@attrs.define(frozen=True, kw_only=True)
class LayerSpec:
    """Everything a layer cache needs from the session, resolved once per plan layer."""

    plan: LayerPlan
    prefill_rule: Any = None
    """Rule object of the prefill op, or None for ``full``."""
    decode_rule: Any = None
    """Rule object of the decode op, or None for ``full``."""
    attention_type: str = "full_attention"
    """The model's attention type of this layer (``full_attention``, ``sliding_attention``, ``chunked_attention``)."""
    window: int | None = None
    """Sliding window or chunk size of a windowed layer (None for full attention)."""
    token_bound: int | None = None
    """Most tokens per head the layer keeps whatever the plan says (``window - 1``; None = unbounded)."""
    low_rank: Any = None
    """The layer's :class:`~polykv.attention.low_rank.LowRank` bases (CPU float32) when the plan gives it a
    rank: keys and values are stored, scored and attended as codes; None: full width."""


def layer_spec(lp: LayerPlan, registry, geometry: ModelGeometry, model_data: Mapping[str, Any]) -> LayerSpec:
    """The :class:`LayerSpec` of plan layer ``lp``: its rule objects from ``registry``, its attention type and
    window from ``geometry``, its bases from ``model_data`` when the plan gives it a rank."""
    rules = {}
    for phase in ("prefill", "decode"):
        op = getattr(lp, phase)
        rules[phase] = None if op.keeps_everything else registry.operator(op.rule)(**op.params)
    geo, i = geometry, lp.layer
    windowed = geo.is_windowed(i)
    return LayerSpec(plan=lp, prefill_rule=rules["prefill"], decode_rule=rules["decode"],
                     attention_type=geo.layer_types[i] if windowed else FULL,
                     window=geo.sliding_window if windowed else None, token_bound=geo.token_bound(i),
                     low_rank=_low_rank(lp, model_data))


def _low_rank(lp: LayerPlan, model_data: Mapping[str, Any]):
    """The layer's bases (:class:`~polykv.attention.low_rank.LowRank`) when the plan gives it a rank, else None."""
    if not lp.low_rank:
        return None
    from polykv.attention.low_rank import LowRank
    from polykv.models.kv_bases import KV_BASES_KEY

    bases = model_data[KV_BASES_KEY]
    return LowRank(None if lp.k_rank is None else bases.basis("key", lp.layer, lp.k_rank),
                   None if lp.v_rank is None else bases.basis("value", lp.layer, lp.v_rank))


@attrs.define(frozen=True, kw_only=True, eq=False)
class CacheSettings:
    """What every layer of one cache reads from the session, passed to each :class:`LayerCache` at construction."""

    registry: Any
    """The plugin registry (the quantizers of the stores, the contract checks)."""
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


@attrs.define(frozen=True, kw_only=True, eq=False)
class ForwardStep:
    """One forward through one layer: what :meth:`LayerCache.begin` made ready for the attention function,
    and what :meth:`LayerCache.after_attention` finishes. K is the number of keys attended
    (stored + q new; during prefill the whole prompt so far)."""

    layer_idx: int
    phase: str
    """``"prefill"`` (the prompt is not stored yet) or ``"decode"``."""
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
    """Sliding window or chunk size (None for full attention); the attention function's mask reads it."""
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


def new_rule_states(spec: LayerSpec) -> dict[str, Any]:
    """Fresh states of the layer's two rules; equal ``share_key`` -> one object serves both."""
    pre = spec.prefill_rule.new_state() if spec.prefill_rule is not None else None
    dec = spec.decode_rule.new_state() if spec.decode_rule is not None else None
    if pre is not None and dec is not None and pre.share_key is not None and pre.share_key == dec.share_key:
        dec = pre
    return {"prefill": pre, "decode": dec}
