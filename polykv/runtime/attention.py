"""The session's attend: what one layer's forward does between its cache ``update`` and the model's output
projection (the part of attention that knows a layer cache; the math is :mod:`polykv.attention.kernels`).

A :class:`~polykv.runtime.layer_cache.LayerCache` ``update`` begins the forward, and hands its
:class:`~polykv.runtime.layer_spec.ForwardStep` over with the keys it returns
(:func:`polykv.attention.attach.hand_over`): transformers' attention call then reaches :func:`serve` with that
layer and step as explicit arguments. :func:`serve` refuses what the runtime cannot serve (a 4D mask, attention
weights, dropout in training, a window the geometry does not record), attends as
the step says (the prompt, the dense view, or straight from the stores), then hands the step back to
:meth:`~polykv.runtime.layer_cache.LayerCache.after_attention` (its states observe, it selects or evicts).
"""

from __future__ import annotations

import torch

from polykv.attention.kernels import eager_attention, sdpa, window_visibility
from polykv.attention.signals import AttentionSignals, attention_with_signals, signal_request
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import SLIDING
from polykv.runtime.probe_pass import probe_attention


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
    _check_window(step, layer_idx, kwargs.get("sliding_window"))
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
    visible = None if step.window is None else window_visibility(
        step.positions, step.first_position, query.shape[2], window=step.window, attention_type=step.attention_type,
        same_rows=step.phase == "prefill")
    signals = None
    if step.stores is not None:
        out = step.stores.attend(query, scaling)
    elif softcap is not None or sinks is not None:
        out = eager_attention(query, key, value, scaling, step.valid, visible=visible, softcap=softcap, sinks=sinks)
    elif visible is None:
        out, signals = attention_and_signals(step, query, key, value, scaling, step.valid)
    else:
        out = sdpa(query, key, value, scaling, step.valid, visible=visible)
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
    if model_window is None or (step.attention_type == SLIDING and step.window == int(model_window)):
        return
    raise RuntimeConfigError(
        f"layer {layer_idx}: the model attends with sliding window {model_window} but its geometry records "
        f"'{step.attention_type}' (window {step.window}); the config's layer_types/sliding_window disagree with "
        f"the attention modules, so the polykv runtime cannot serve this model")
