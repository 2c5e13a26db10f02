"""One layer of the runtime without a model: the supported entry point for code that measures what the runtime
does to one layer (calibration's layer-local errors) instead of building its internal classes.

:func:`build_layer` builds the runtime's own layer cache of a plan layer, :func:`forward_layer` runs one forward
through it as the model would (begin, attend, observe, select or evict), :func:`observe_prompt` lets its states
observe a prompt without attending (selection waits), and :func:`new_storage` is a plan layer's stores on their
own. Shapes: B batch, H query heads, Hkv KV heads, q new tokens, d head dim.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from polykv.plan import LayerPlan
from polykv.attention.attach import attend
from polykv.runtime.layer_cache import LayerCache
from polykv.runtime.layer_spec import CacheSettings
from polykv.runtime.session import layer_spec
from polykv.runtime.storage import LayerStorage, new_store, quantizer_of


def build_layer(lp: LayerPlan, registry, *, model_data: Mapping[str, Any] | None = None, decode_slack: int = 1,
                rope_inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0,
                generator: torch.Generator | None = None) -> LayerCache:
    """The layer cache of plan layer ``lp`` (full attention), its rules and quantizer from ``registry``, its
    bases from ``model_data`` when the plan gives it a rank; empty until its first forward."""
    settings = CacheSettings(decode_slack=decode_slack, rope_inv_freq=rope_inv_freq, rope_scaling=rope_scaling,
                             model_data=dict(model_data or {}), generator=generator)
    return LayerCache(layer_idx=lp.layer, spec=layer_spec(lp, registry, None, model_data), settings=settings)


def forward_layer(layer: LayerCache, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, scaling: float,
                  *, ends_prompt: bool = True) -> torch.Tensor:
    """One forward of q new post-RoPE ``keys``/``values`` [B, Hkv, q, d] and ``query`` [B, H, q, d] through
    ``layer``, attended by the runtime's attention; returns the attention output [B, H, q, d]."""
    step = layer.begin(keys, values, ends_prompt=ends_prompt)
    out, signals = attend(step, layer.low_rank, query, step.keys, step.values, scaling)
    layer.after_attention(step, query, scaling, signals=signals)
    return out


def observe_prompt(layer: LayerCache, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                   scaling: float, attention_input: torch.Tensor | None = None) -> None:
    """A prompt [B, Hkv, T, d] held by ``layer`` and observed by its states (which compute what they read
    themselves; ``attention_input`` [B, T, D]: the hidden states that entered the layer's attention, for states that
    read them), selection left for later (``layer.select_prompt``)."""
    step = layer.begin(keys, values, ends_prompt=False)
    if attention_input is not None:
        layer.settings.attention_inputs[layer.layer_idx] = attention_input
    layer.after_attention(step, query, scaling)


def new_storage(lp: LayerPlan, registry, *, dtype: torch.dtype, device) -> LayerStorage:
    """Empty stores (and positions) of plan layer ``lp``, its quantizer built once."""
    quantizer = quantizer_of(registry, lp)
    return LayerStorage(lambda stream: new_store(quantizer, lp, stream, dtype=dtype, device=device))
