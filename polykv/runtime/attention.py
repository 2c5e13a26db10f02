"""The attention function and mask function registered with transformers under the name ``polykv``.

transformers 5.x calls ``fn(module, query, key, value, attention_mask, scaling=..., **kw)`` after the
cache update, with post-RoPE ``query`` [B, H, q, d] and the unrepeated ``key``/``value``
[B, Hkv, K, d] that :meth:`LayerCache.update` returned. It passes no cache (measured on 5.24: the
keyword arguments are ``dropout``, ``scaling``, ``position_ids``, ``use_cache``, ``sliding_window``,
``softcap``, ``s_aux`` and router flags, never the cache), so the function reaches the cache through
the module: the session serving it is the module's :data:`SESSION_ATTRIBUTE` while the session is
active (:func:`bind`), and the session hands over the layer's
:class:`~polykv.runtime.layer_cache.ForwardStep` (:meth:`Session.step_for`), which says what to attend.
The function attends, then returns the step to :meth:`LayerCache.after_attention`.

The model-wide mask is ignored (it would be sized from layer 0); each layer's mask is built here from
its own step:

* full attention: every stored token precedes the q new ones, so one lower-right causal [q, K] mask
  serves every head, whatever each head retained (a ragged layer's padding columns, ``valid``, are
  masked too);
* sliding-window and chunked layers (:data:`polykv.models.geometry.WINDOWED`): the mask is computed from the
  original position of every attended token per head (``ForwardStep.positions``), so a query sees exactly
  the tokens of its window or chunk, as in the model's own mask.

Plain softmax attention runs in :func:`torch.nn.functional.scaled_dot_product_attention`; logit
softcapping (Gemma 2) and learned attention sinks (gpt-oss ``s_aux``) run in :func:`eager_attention`,
in query chunks. GQA keys are never repeated in storage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from polykv.errors import RuntimeConfigError
from polykv.models.geometry import CHUNKED, SLIDING
from polykv.attention.signals import (AttentionSignals, attention_with_signals, chunked_attention, lower_right_causal,
                                      signal_request)
from polykv.attention.online_softmax import decode_attention_from_stores, decode_attention_per_head

NAME = "polykv"

SESSION_ATTRIBUTE = "polykv_session"
"""Attribute of an attention module naming the Session that serves it (set on ``__enter__``, removed on exit)."""


def bind(module: torch.nn.Module, session) -> None:
    """Let ``session`` serve ``module``'s attention (until :func:`unbind`)."""
    module.__dict__[SESSION_ATTRIBUTE] = session


def unbind(module: torch.nn.Module) -> None:
    module.__dict__.pop(SESSION_ATTRIBUTE, None)


def serving_session(module: torch.nn.Module):
    """The session :func:`bind` gave ``module``, or None."""
    return module.__dict__.get(SESSION_ATTRIBUTE)


_SDPA_MASK_ELEMENTS = 1 << 22
"""Mask entries per query-row chunk of :func:`sdpa` with a mask (4 Mi: 16 MiB as float32)."""
_EAGER_CHUNK_ELEMENTS = 1 << 22
"""Logits per query chunk of :func:`eager_attention` (16 MiB in float32)."""


def window_visibility(step, q: int) -> torch.Tensor | None:
    """Which keys the q new queries of a windowed layer's ``step`` may see; None for a full-attention layer.

    Returns [q, K] bool during prefill (every head holds the raw prompt) and [B, Hkv, q, K] after it
    (heads may hold different tokens), from the original positions of the K attended keys.
    """
    if step.window is None:
        return None
    keys = step.positions
    if step.phase == "prefill":
        keys = keys[0, 0]
    first = step.first_position
    rows = torch.arange(first, first + q, device=keys.device).unsqueeze(1)                         # (q, 1)
    cols = keys.unsqueeze(-2)                                                                       # (..., 1, K)
    visible = cols <= rows
    if step.attention_type == CHUNKED:
        return visible & (torch.div(cols, step.window, rounding_mode="floor")
                          == torch.div(rows, step.window, rounding_mode="floor"))
    return visible & (cols > rows - step.window)


def _group_mask(visible: torch.Tensor, G: int, q: int) -> torch.Tensor:
    """[q, K] or [B, Hkv, q, K] visibility -> the (.., G*q, K) mask of G query heads folded per KV head."""
    if visible.dim() == 2:
        return visible.repeat(G, 1)
    B, Hkv, _, K = visible.shape
    return visible.unsqueeze(2).expand(B, Hkv, G, q, K).reshape(B, Hkv, G * q, K)


def _mask(q: int, K: int, device, visible: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor | None:
    """Window visibility ([q, K] or [B, Hkv, q, K]) and/or ragged padding ([B, Hkv, K]) as one bool mask
    (None: plain lower-right causal attention)."""
    if valid is None:
        return visible
    base = lower_right_causal(q, K, device) if visible is None else visible
    return base & valid.unsqueeze(-2)                                              # (B, Hkv, q, K)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
         valid: torch.Tensor | None = None, *, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last q positions over K keys: [B, H, q, d].

    Parameters
    ----------
    query : [B, H, q, d]
    key, value : [B, Hkv, K, d], K >= q, the q new tokens last.
    valid : [B, Hkv, K] bool, optional
        False on the padding columns of a ragged layer (heads holding fewer tokens than the longest,
        padded at the front); those columns are never attended.
    visible : None for lower-right causal attention, else the [q, K] or [B, Hkv, q, K] bool mask of
        :func:`window_visibility` (a sliding-window or chunked layer).
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    mask = _mask(q, K, query.device, visible, valid)
    if mask is not None and q == 1 and bool(mask.all()):
        mask = None  # a decode step that sees every stored token
    if mask is None and q == K:
        # No stored tokens: plain causal attention.
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=G > 1)
    if mask is None and q == 1:
        # One query sees every key: fold the G heads of a group into the query axis, no mask
        # (measured faster on CPU than enable_gqa, and far faster than repeating K/V).
        out = F.scaled_dot_product_attention(query.view(B, Hkv, G, d), key, value, scale=scaling)  # (B, Hkv, G, d)
        return out.view(B, H, 1, -1)
    # Several new tokens after stored ones, a window or padding: fold the G heads of a group into the query axis,
    # in query-row chunks whose mask holds at most _SDPA_MASK_ELEMENTS entries (SDPA turns a bool mask into a
    # float one: a probe chunk of 2k queries over an 8k prompt would otherwise take ~200 MB per layer).
    causal = mask is None
    per_row = G * K * (B * Hkv if mask is not None and mask.dim() == 4 else 1)
    rows = max(1, min(q, _SDPA_MASK_ELEMENTS // per_row))
    out = query.new_empty(B, H, q, value.shape[-1])
    for a in range(0, q, rows):
        b = min(a + rows, q)
        n = b - a
        qg = query[:, :, a:b].reshape(B, Hkv, G * n, d)                           # (B, Hkv, G*n, d)
        if causal:  # rows a..b see the keys up to their own: the first K - q + b
            end = K - q + b
            part = F.scaled_dot_product_attention(qg, key[:, :, :end], value[:, :, :end], scale=scaling,
                                                  attn_mask=_group_mask(lower_right_causal(n, end, query.device), G, n))
        else:
            part = F.scaled_dot_product_attention(qg, key, value, scale=scaling,
                                                  attn_mask=_group_mask(mask[..., a:b, :], G, n))
        out[:, :, a:b] = part.view(B, H, n, -1)
    return out


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    valid: torch.Tensor | None = None, *, visible: torch.Tensor | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with logit softcapping and/or learned sinks, as transformers' eager kernels compute it.

    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` before masking (Gemma 2).
    ``sinks`` [H]: one extra logit per head joins every softmax and is then dropped (gpt-oss).
    Shapes as :func:`sdpa`; queries run in chunks of at most 4 Mi logits.
    """
    return chunked_attention(query, key, value, scaling, valid, visible=visible, softcap=softcap, sinks=sinks,
                             eager=True, chunk_elements=_EAGER_CHUNK_ELEMENTS)


def polykv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: attend as the layer's step says, then hand the step back to the
    layer cache (its states observe, it selects or evicts)."""
    session = serving_session(module)
    layer_idx = getattr(module, "layer_idx", None)
    if session is None:
        raise RuntimeConfigError(
            f"attention layer {layer_idx} runs with attn_implementation '{NAME}' but no polykv session serves it; "
            f"call the model inside 'with polykv.apply(model, plan) as session:'")
    layer, step = session.step_for(layer_idx, key)
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
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    low_rank, full_query = layer.low_rank, query
    if low_rank is not None:  # codes: logits (P^T q) . c with the head dim's own scaling
        query = low_rank.queries(query)
    visible = window_visibility(step, query.shape[2])
    valid = step.valid
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    plain = softcap is None and sinks is None
    signals = None
    if step.stores is not None:
        if not plain:  # known from the prefill forward, so never reached in practice
            raise RuntimeConfigError(f"layer {layer_idx}: attention read from the stores has no softcap or sinks, "
                                     f"but this forward asks for them; set the layer's read_stores = False")
        out = attend_stores_of(step.stores, query, scaling)
    elif visible is None and plain:
        out, signals = attention_and_signals(step, query, key, value, scaling, valid)
    elif plain:
        out = sdpa(query, key, value, scaling, valid, visible=visible)
    else:
        out = eager_attention(query, key, value, scaling, valid, visible=visible, softcap=softcap, sinks=sinks)
    layer.after_attention(step, full_query, scaling, signals=signals, plain=plain)
    if low_rank is not None:
        out = low_rank.lift(out)                                                   # (B, H, q, d)
    return out.transpose(1, 2).contiguous(), None


def attend_stores_of(storage, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over a layer's stores, without its dense view: one call over a
    uniform layer's two stores, or each (batch row, KV head) of a ragged layer over its own segment."""
    if storage.ragged:
        return decode_attention_per_head(query, [(seg.key, seg.value) for seg in storage.segments], scaling=scaling)
    return decode_attention_from_stores(query, storage.key_store, storage.value_store, scaling=scaling)


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
