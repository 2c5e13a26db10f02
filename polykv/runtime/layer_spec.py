"""What a layer cache is built from, what one forward through it carries, and what that forward does in attention.

:class:`LayerSpec` (one per plan layer, resolved once by :func:`layer_spec`: its rule objects, its quantizer, its
window, its bases, whether its attention is a plain softmax), :class:`CacheSettings` (what every layer of one
cache reads from the session) and :class:`ForwardStep` (one forward through one layer, from
:meth:`~polykv.runtime.layer_cache.LayerCache.begin` to
:meth:`~polykv.runtime.layer_cache.LayerCache.after_attention`).

:func:`serve` is the step in attention: a layer cache's ``update`` hands its step over with the keys it returns
(:func:`polykv.attention.attach.hand_over`), and transformers' attention call reaches :func:`serve` with that layer
and step as explicit arguments. It refuses what the runtime cannot serve (a 4D mask, attention weights, dropout in
training, a window the geometry does not record), attends as the step says (:func:`attend`: the prompt, the dense
view, or straight from the stores; the math is :mod:`polykv.attention.kernels`), then hands the step back to
:meth:`~polykv.runtime.layer_cache.LayerCache.after_attention` (its states observe, it selects or evicts).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from polykv.attention.kernels import eager_attention, sdpa, window_visibility
from polykv.attention.low_rank import LowRank
from polykv.attention.signals import AttentionSignals, attention_with_signals, signal_request
from polykv.errors import RuntimeConfigError
from polykv.runtime.plugin_results import StoreContract, StreamSpec
from polykv.runtime.probe_pass import probe_attention
from polykv.models.geometry import FULL, SLIDING, ModelGeometry
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan import PASSTHROUGH_BITS, LayerPlan
from polykv.runtime.storage import LayerStorage, StorageView, new_store, quantizer_of


@attrs.define(frozen=True, kw_only=True)
class LayerSpec:
    """Everything a layer cache needs from the session, resolved once per plan layer (:func:`layer_spec`)."""

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

    def plan_capacity(self, phase: str, tokens_seen: int) -> int | None:
        """Tokens per head the plan's ``phase`` op keeps after ``tokens_seen`` tokens (None: everything)."""
        return getattr(self.plan, phase).resolve_capacity(tokens_seen)

    def new_store(self, stream: str, *, dtype: torch.dtype, device, storage_dtype: torch.dtype | None = None):
        """An empty store of ``stream`` ("key" or "value") from this layer's quantizer and bit widths."""
        return new_store(self.quantizer, self.plan, stream, dtype=dtype, device=device, storage_dtype=storage_dtype)

    def store_contract(self, *, storage_dtype: torch.dtype | None, full: bool) -> StoreContract:
        """The checks of this layer's stores (:class:`~polykv.runtime.plugin_results.StoreContract`); a layer cache
        builds them for a quantized layer, or for any layer with the expensive checks on (``full``)."""
        lp = self.plan
        streams = {stream: StreamSpec(None, bits) if bits == PASSTHROUGH_BITS
                   else StreamSpec(lp.quantizer, bits, self.quantizer)
                   for stream, bits in (("key", lp.k_bits), ("value", lp.v_bits))}
        return StoreContract(layer_idx=lp.layer, streams=streams, storage_dtype=storage_dtype, full=full)

    def new_states(self) -> dict[str, Any]:
        """Fresh states of the layer's two rules; equal ``share_key`` -> one object serves both."""
        pre = self.prefill_rule.new_state() if self.prefill_rule is not None else None
        dec = self.decode_rule.new_state() if self.decode_rule is not None else None
        if pre is not None and dec is not None and pre.share_key is not None and pre.share_key == dec.share_key:
            dec = pre
        return {"prefill": pre, "decode": dec}


def layer_spec(lp: LayerPlan, registry, geometry: ModelGeometry | None = None,
               model_data: Mapping[str, Any] | None = None, *, plain: bool = True) -> LayerSpec:
    """The :class:`LayerSpec` of plan layer ``lp``: its rule and quantizer objects from ``registry``, its attention
    type and window from ``geometry`` (None: full attention), its bases from ``model_data`` when the plan gives it
    a rank; ``plain``: no softcap or sinks on its attention module."""
    rules = {}
    for phase in ("prefill", "decode"):
        op = getattr(lp, phase)
        rules[phase] = None if op.keeps_everything else registry.rule(op.rule)(**op.params)
    windowed = geometry is not None and geometry.is_windowed(lp.layer)
    return LayerSpec(plan=lp, prefill_rule=rules["prefill"], decode_rule=rules["decode"],
                     quantizer=quantizer_of(registry, lp),
                     attention_type=geometry.layer_types[lp.layer] if windowed else FULL,
                     window=geometry.sliding_window if windowed else None,
                     token_bound=geometry.token_bound(lp.layer) if geometry is not None else None,
                     low_rank=_low_rank(lp, model_data or {}) if lp.low_rank else None, plain=plain)


def _low_rank(lp: LayerPlan, model_data: Mapping[str, Any]) -> LowRank:
    """The bases of a layer the plan gives a rank."""
    bases = model_data[KV_BASES_KEY]
    return LowRank(None if lp.k_rank is None else bases.basis("key", lp.layer, lp.k_rank),
                   None if lp.v_rank is None else bases.basis("value", lp.layer, lp.v_rank))


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


# -- the step in attention ------------------------------------------------------------------------------------


def serve(layer, step, module, query, key, value, attention_mask, *, scaling: float, dropout: float = 0.0, **kwargs):
    """Attend ``step`` of ``layer`` (both from the layer's ``update``) for ``module``; ``query`` [B, H, q, d].
    Returns the output as transformers wants it, [B, q, H, d], and no attention weights."""
    layer_idx = step.layer_idx
    if attention_mask is not None:
        raise RuntimeConfigError(
            f"layer {layer_idx}: the attention function received a 4D attention mask (one passed by the caller, or "
            f"one the model builds itself); the polykv runtime builds its own masks and supports only unpadded "
            f"batches: pass no 4D mask (a model that builds its own masks cannot be served)")
    if kwargs.get("output_attentions"):
        raise RuntimeConfigError("output_attentions is not supported by the polykv runtime (attention runs in SDPA)")
    if dropout and module.training:
        raise RuntimeConfigError(f"layer {layer_idx}: the polykv runtime serves attention in eval mode; this model "
                                 f"asks for attention dropout in training mode (call model.eval())")
    if kwargs.get("sliding_window") is not None:  # the model's own window: only a windowed model passes one
        _check_window(step, layer_idx, kwargs["sliding_window"])
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if layer.spec.plain and (softcap is not None or sinks is not None):
        raise RuntimeConfigError(
            f"layer {layer_idx}: polykv.apply found no logit softcapping and no attention sinks on this attention "
            f"module, but its forward asks for them; the model's attention modules disagree with what they attend "
            f"with, so the polykv runtime cannot serve this model")
    out, signals = attend(step, layer.low_rank, query, key, value, scaling, softcap, sinks)
    layer.after_attention(step, query, scaling, signals=signals)
    return out.transpose(1, 2).contiguous(), None


def attend(step, low_rank, query, key, value, scaling: float, softcap=None, sinks=None):
    """The output [B, H, q, d] of ``query`` over what ``step`` attends (``key``/``value`` are its keys; a
    low-rank layer's codes, attended in code space and lifted), and the signals its states read, if computed."""
    if step.probe is not None and (own := probe_attention(step, low_rank, softcap, sinks)) is not None:
        return own(query, key, value, scaling, step.probe, step.first_position), None  # the probe state attends
    if low_rank is not None:  # codes: logits (P^T q) . c with the head dim's own scaling
        query = low_rank.queries(query)
    view = step.view
    visible = None if step.window is None else window_visibility(
        view.positions, step.first_position, query.shape[2], window=step.window, attention_type=step.attention_type,
        same_rows=step.phase == "prefill")
    signals = None
    if step.stores is not None:
        out = step.stores.attend(query, scaling)
    elif softcap is not None or sinks is not None:
        out = eager_attention(query, key, value, scaling, view.valid, visible=visible, softcap=softcap, sinks=sinks)
    elif visible is None:
        out, signals = attention_and_signals(step, query, key, value, scaling, view.valid)
    else:
        out = sdpa(query, key, value, scaling, view.valid, visible=visible)
    return (out if low_rank is None else low_rank.lift(out)), signals


def attention_and_signals(step, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          valid: torch.Tensor | None) -> tuple[torch.Tensor, AttentionSignals | None]:
    """A forward (``step``) of a full-attention layer: the output [B, H, q, d] and the signals its states need.

    The states observing the step declare what they read (``RuleState.needs``).
    :func:`~polykv.attention.signals.attention_with_signals` computes the output and every declared
    signal in one pass when that saves work: in prefill when some state reads column sums (every
    query row contributes), and in every decode step whose states read anything (one query row: its
    probabilities are the attention's own). Otherwise plain SDPA and no signals: in prefill the newest
    rows alone cost ``r x K`` whenever they are computed, so states compute them when they select (a
    layer waiting for its allocation group holds no rows meanwhile), and the keep-everything plan
    stays vanilla.
    """
    request = signal_request(step.states)
    if request.needs_every_row or (request and step.phase == "decode"):
        return attention_with_signals(query, key, value, scaling, request, valid)
    return sdpa(query, key, value, scaling, valid), None


def _check_window(step, layer_idx, model_window) -> None:
    """The model's own ``sliding_window`` argument must agree with the layer's recorded attention type."""
    if step.attention_type == SLIDING and step.window == int(model_window):
        return
    raise RuntimeConfigError(
        f"layer {layer_idx}: the model attends with sliding window {model_window} but its geometry records "
        f"'{step.attention_type}' (window {step.window}); the config's layer_types/sliding_window disagree with "
        f"the attention modules, so the polykv runtime cannot serve this model")
