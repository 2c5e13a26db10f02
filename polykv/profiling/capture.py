"""One captured forward: every layer's post-RoPE queries, keys and values of a calibration sequence.

A capturing attention function is registered with transformers' ``AttentionInterface`` (and a
mask function with ``AttentionMaskInterface``, so the model-wide mask is never built) under the
name ``polykv-capture``. It records what the attention layer received (post-RoPE ``query``
[B, H, T, d], unrepeated ``key`` / ``value`` [B, Hkv, T, d]) and attends with the runtime's own
causal SDPA kernel (:func:`polykv.runtime.attention.sdpa`), so the forward is the model's usual
one. The model's attention implementation is restored on exit, whatever happens.

Shapes: B sequences (1 per forward), H query heads, Hkv KV heads, T tokens, d head dim.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import attrs
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from polykv.errors import ProfileError
from polykv.runtime.attention import sdpa

NAME = "polykv-capture"


@attrs.define(frozen=True, kw_only=True, eq=False)
class LayerCapture:
    """What one attention layer saw during one forward."""

    layer_idx: int
    query: torch.Tensor
    """[B, H, T, d] post-RoPE queries (B = 1 per forward; :func:`stack_layer` stacks sequences)."""
    key: torch.Tensor
    """[B, Hkv, T, d] post-RoPE keys (unrepeated)."""
    value: torch.Tensor
    """[B, Hkv, T, d] values."""
    scaling: float
    """Attention scaling the layer used."""
    o_proj: torch.nn.Module | None = None
    """The layer's output projection ([B, T, H*d] -> [B, T, hidden]), when it has one."""

    @property
    def num_tokens(self) -> int:
        return self.key.shape[2]


def stack_layer(captures: list[list[LayerCapture]], layer: int) -> LayerCapture:
    """One layer of several same-length captured sequences as batch rows: query [B, H, T, d], ..."""
    caps = [c[layer] for c in captures]
    lengths = sorted({c.num_tokens for c in caps})
    if len(lengths) != 1:
        raise ProfileError(f"layer {layer}: calibration sequences must share one length to be processed together, "
                           f"got lengths {lengths}")
    first = caps[0]
    return LayerCapture(layer_idx=layer, query=torch.cat([c.query for c in caps]), key=torch.cat([c.key for c in caps]),
                        value=torch.cat([c.value for c in caps]), scaling=first.scaling, o_proj=first.o_proj)


_ACTIVE: list[dict[int, LayerCapture]] = []


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Record (query, key, value) of ``module`` and attend causally (no padding, no cache)."""
    if not _ACTIVE:
        raise ProfileError(f"attention implementation '{NAME}' runs only inside polykv.profiling.capture.capturing()")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if query.shape[2] != key.shape[2]:
        raise ProfileError(f"layer {module.layer_idx}: capture expects a cache-free forward (query and key lengths "
                           f"{query.shape[2]} != {key.shape[2]}); call the model with use_cache=False")
    _ACTIVE[-1][module.layer_idx] = LayerCapture(
        layer_idx=module.layer_idx, query=query.detach(), key=key.detach(), value=value.detach(),
        scaling=float(scaling), o_proj=getattr(module, "o_proj", None))
    out = sdpa(query, key, value, scaling)                                    # (B, H, T, d)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, attention_mask=None, **kwargs):
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise ProfileError("calibration sequences must be unpadded (the attention mask has zeros)")
    return None


def register() -> None:
    """Register the capturing attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(NAME, _capture_attention)
    AttentionMaskInterface.register(NAME, _no_mask)


@contextlib.contextmanager
def capturing(model) -> Iterator[dict[int, LayerCapture]]:
    """Within the block, forwards of ``model`` fill the yielded dict {layer index: LayerCapture}."""
    register()
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation_internal")}
    saved = [(c, c._attn_implementation_internal) for c in configs.values()]
    found: dict[int, LayerCapture] = {}
    _ACTIVE.append(found)
    try:
        for c in configs.values():
            c._attn_implementation_internal = NAME
        yield found
    finally:
        _ACTIVE.remove(found)
        for c, impl in saved:
            c._attn_implementation_internal = impl


@torch.no_grad()
def capture_sequence(model, input_ids: torch.Tensor) -> list[LayerCapture]:
    """Run one cache-free forward of ``input_ids`` [T] or [1, T]; return every layer's capture in order.

    Raises
    ------
    ProfileError
        When some layer did not go through the attention interface (the model's attention does not
        dispatch on ``config._attn_implementation``).
    """
    ids = torch.as_tensor(input_ids)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ProfileError(f"capture takes one sequence of token ids, [T] or [1, T]; got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    with capturing(model) as found:
        model(input_ids=ids.to(device), use_cache=False)
    layers = int(model.config.get_text_config().num_hidden_layers)
    if sorted(found) != list(range(layers)):
        raise ProfileError(f"{type(model).__name__}: captured layers {sorted(found)}, expected 0..{layers - 1}; "
                           "calibration needs decoders whose attention uses the transformers AttentionInterface")
    return [found[i] for i in range(layers)]
