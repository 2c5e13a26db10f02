"""Which decoders the runtime can serve, decided from the model before anything is patched.

Served: decoders whose every layer is softmax attention over a per-head K/V cache, through the
transformers ``AttentionInterface``: full, sliding-window and chunked attention; GQA, MQA and plain
multi-head attention; logit softcapping and learned attention sinks. Refused, with one line naming the
model type, the reason and what is served:

* multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): the cache holds compressed latents,
  not per-head keys and values;
* differential attention (DiffLlama): each layer subtracts two softmax attentions;
* layers that keep recurrent, linear-attention or convolution state (Mamba, Falcon-H1, ...);
* layers that reuse another layer's K/V (KV sharing, Gemma 3n);
* layers with different KV head counts or head dims (one plan shape per model);
* bidirectional encoders loaded as causal LMs (BERT-style ``*ForCausalLM`` without ``is_decoder``);
* attention modules that compute attention themselves instead of dispatching through the
  ``AttentionInterface`` (BLOOM's and Falcon's ALiBi kernels): checked on the modules a session patches
  (:func:`attention_modules`).
"""

from __future__ import annotations

import functools
import inspect

import torch

from polykv.errors import RuntimeConfigError
from polykv.models.geometry import FULL, WINDOWED

SERVED = ("decoders whose every layer is softmax attention over a per-head K/V cache (full, sliding-window or "
          "chunked; GQA, MQA or multi-head; optional logit softcapping or attention sinks) through the "
          "transformers AttentionInterface")
_ATTENTION_TYPES = (FULL, *WINDOWED)
_STATE_MODULES = ("Mamba", "Mixer", "GatedDeltaNet", "LinearAttention", "ShortConv", "RecurrentBlock", "Rwkv",
                  "SSM")


def refusal_reason(model) -> str | None:
    """Why the runtime cannot serve ``model`` (one clause), or None when it can."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "kv_lora_rank", None) is not None:
        return ("multi-head latent attention caches compressed latents (kv_lora_rank), not per-head keys and "
                "values that a plan could select or quantize")
    if hasattr(config, "lambda_std_dev") or any(type(m).__name__.startswith("DiffLlama") and
                                                type(m).__name__.endswith("Attention") for m in model.modules()):
        return "differential attention subtracts two softmax attentions per layer"
    types = [str(t) for t in (getattr(config, "layer_types", None) or [])]
    other = sorted({t for t in types if t not in _ATTENTION_TYPES + ("mlp", "moe")})
    if other:
        return f"its {', '.join(other)} layers keep state that is not a per-head K/V cache"
    stateful = sorted({type(m).__name__ for m in model.modules()
                       if any(word in type(m).__name__ for word in _STATE_MODULES)})
    if stateful:
        return f"its layers keep recurrent, linear-attention or convolution state ({', '.join(stateful[:3])})"
    shared = getattr(config, "num_kv_shared_layers", None) or getattr(config, "kv_sharing_modes", None)
    if shared:
        return "some layers reuse another layer's keys and values (KV sharing)"
    if getattr(config, "is_heterogeneous", False):
        return "its layers differ in KV heads or head dim, and a plan has one shape for every layer"
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    if attention and not any(bool(m.is_causal) for m in attention):
        return "its attention is bidirectional (an encoder), not causal"
    return None


def attention_bypasses_interface(module) -> bool:
    """True when an attention module's (or attention class's) ``forward`` computes attention itself, never through
    transformers' ``ALL_ATTENTION_FUNCTIONS`` (BLOOM; Falcon up to transformers 5.24): polykv's attention function
    would never run there."""
    return _forward_bypasses((module if isinstance(module, type) else type(module)).forward)


@functools.lru_cache(maxsize=256)
def _forward_bypasses(forward) -> bool:
    """:func:`attention_bypasses_interface` of one ``forward`` function: its source is read once per process (reading
    it took 5 ms per layer, and calibration opens a session for each of hundreds of one-layer plans)."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False  # no source to read: the runtime's per-forward check still catches it
    return "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source


def attention_modules(model, num_layers: int) -> list[torch.nn.Module]:
    """The self-attention module of every layer: the first ``*Attention`` module that knows its ``layer_idx``."""
    found: dict[int, torch.nn.Module] = {}
    for _, m in model.named_modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and type(m).__name__.endswith("Attention") \
                and not getattr(m, "is_cross_attention", False):
            found.setdefault(idx, m)
    if sorted(found) != list(range(num_layers)):
        raise RuntimeConfigError(
            f"model type '{model_type(model)}' cannot be served by polykv: found attention modules for layers "
            f"{sorted(found)}, expected 0..{num_layers - 1}; supported are {SERVED}")
    bypass = [i for i in range(num_layers) if attention_bypasses_interface(found[i])]
    if bypass:
        raise RuntimeConfigError(
            f"model type '{model_type(model)}' cannot be served by polykv: {type(found[bypass[0]]).__name__} "
            f"computes attention itself instead of dispatching through the transformers AttentionInterface; "
            f"supported are {SERVED}")
    return [found[i] for i in range(num_layers)]


def check_servable(model) -> None:
    """Raise :class:`RuntimeConfigError` (one line) when :func:`refusal_reason` finds a reason."""
    reason = refusal_reason(model)
    if reason is not None:
        raise RuntimeConfigError(f"model type '{model_type(model)}' cannot be served by polykv: {reason}; "
                                 f"supported are {SERVED}")


def model_type(model) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return str(getattr(config, "model_type", type(model).__name__))


def plain_softmax(module) -> bool:
    """Whether attention module ``module`` computes a plain softmax: no logit softcapping (Gemma 2's
    ``attn_logit_softcapping``) and no learned sinks (gpt-oss's ``sinks``). Decided once, by :func:`polykv.apply`."""
    return getattr(module, "attn_logit_softcapping", None) is None and getattr(module, "sinks", None) is None
