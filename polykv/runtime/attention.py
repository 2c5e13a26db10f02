"""The attention function and mask function registered with transformers under the name ``polykv``.

transformers 5.x calls ``fn(module, query, key, value, attention_mask, scaling=..., **kw)`` after the
cache update, with post-RoPE ``query`` [B, H, q, d] and the unrepeated ``key``/``value``
[B, Hkv, K, d] that :meth:`LayerCache.update` returned. Every stored token precedes the q new
ones, so one lower-right causal [q, K] mask serves every head, whatever each head retained; it is
built here from the layer's own key length (the model-wide mask would be sized from layer 0).
Attention runs in :func:`torch.nn.functional.scaled_dot_product_attention`; GQA keys are never
repeated in storage.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from polykv.errors import RuntimeConfigError
from polykv.runtime.signals import lower_right_causal

NAME = "polykv"

_BOUND: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
"""Attention module -> the Session that serves it (set on ``__enter__``, removed on exit)."""


def bind(module: torch.nn.Module, session) -> None:
    _BOUND[module] = session


def unbind(module: torch.nn.Module) -> None:
    _BOUND.pop(module, None)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
         valid: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last q positions over K keys: [B, H, q, d].

    Parameters
    ----------
    query : [B, H, q, d]
    key, value : [B, Hkv, K, d], K >= q, the q new tokens last.
    valid : [B, Hkv, K] bool, optional
        False on the padding columns of a ragged layer (heads holding fewer tokens than the longest,
        padded at the front); those columns are never attended.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    if valid is not None:
        qg = query.reshape(B, Hkv, G * q, d)                                      # (B, Hkv, G*q, d)
        mask = lower_right_causal(q, K, query.device).repeat(G, 1) & valid.unsqueeze(2)  # (B, Hkv, G*q, K)
        out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
        return out.view(B, H, q, -1)
    if q == K:
        # No stored tokens: plain causal attention.
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=G > 1)
    if q == 1:
        # One query sees every key: fold the G heads of a group into the query axis, no mask
        # (measured faster on CPU than enable_gqa, and far faster than repeating K/V).
        out = F.scaled_dot_product_attention(query.view(B, Hkv, G, d), key, value, scale=scaling)  # (B, Hkv, G, d)
        return out.view(B, H, 1, -1)
    # Several new tokens after stored ones: fold the G heads of a group into the query axis.
    qg = query.reshape(B, Hkv, G * q, d)                                          # (B, Hkv, G*q, d)
    mask = lower_right_causal(q, K, query.device).repeat(G, 1)                    # (G*q, K)
    out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.view(B, H, q, -1)


def polykv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: attend, then let the layer cache record signals and evict."""
    session = _BOUND.get(module)
    layer_idx = getattr(module, "layer_idx", None)
    if session is None:
        raise RuntimeConfigError(
            f"attention layer {layer_idx} runs with attn_implementation '{NAME}' but no polykv session serves it; "
            f"call the model inside 'with polykv.apply(model, plan) as session:'")
    layer = session._layer_for(layer_idx, key)
    if attention_mask is not None:
        raise RuntimeConfigError(
            f"layer {layer_idx}: a custom attention mask was passed; the polykv runtime builds its own causal mask "
            f"and supports only unpadded batches (pass no 4D mask)")
    if kwargs.get("output_attentions"):
        raise RuntimeConfigError("output_attentions is not supported by the polykv runtime (attention runs in SDPA)")
    unsupported = [k for k in ("softcap", "sliding_window", "s_aux", "sinks") if kwargs.get(k) is not None]
    if unsupported or (dropout and module.training):
        what = ", ".join(unsupported) or "attention dropout in training mode"
        raise RuntimeConfigError(f"layer {layer_idx}: the polykv runtime serves plain causal softmax attention in "
                                 f"eval mode; this model asks for {what} (call model.eval(), or use another model)")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    out = sdpa(query, key, value, scaling, layer.attend_valid())
    layer.after_attention(query, scaling)
    return out.transpose(1, 2).contiguous(), None


def polykv_mask(batch_size: int = 1, q_length: int = 1, kv_length: int = 1, q_offset: int = 0, kv_offset: int = 0,
                mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask interface: rejects padding, returns None (the attention function builds per-layer masks)."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise RuntimeConfigError(
            "the attention mask has padded positions (zeros): the polykv runtime supports batches of equal, "
            "unpadded lengths only, because per-head eviction would break the padding mask. Run sequences of "
            "different lengths one at a time (batch of 1) or group them by length")
    return None


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(NAME, polykv_attention)
    AttentionMaskInterface.register(NAME, polykv_mask)
