"""One captured forward: every layer's post-RoPE queries, keys and values of a calibration sequence.

The model attends through polykv's one attach point (:func:`polykv.attention.attach.attached`) with a cache
that stores nothing (:class:`~polykv.attention.attach.HandOverCache`) and hands every layer's keys to a
:class:`Capture`: it records what the attention layer received (post-RoPE ``query`` [B, H, T, d], unrepeated
``key`` / ``value`` [B, Hkv, T, d]) and attends with the runtime's own causal SDPA kernel
(:func:`polykv.attention.kernels.sdpa`), so the forward is the model's usual one. The model's attention
implementation is restored on exit, whatever happens.

Shapes: B sequences (1 per forward), H query heads, Hkv KV heads, T tokens, d head dim.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import attrs
import torch
from polykv.attention.attach import AttentionInputs, HandOverCache, attached
from polykv.attention.kernels import sdpa
from polykv.errors import ProfileError
from polykv.runtime.cache import cache_keyword
from polykv.runtime.checks import attention_modules


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
    attention_input: torch.Tensor | None = None
    """[B, T, D] the hidden states entering the attention module, when the capture was asked to keep them (for
    rules that read them, :data:`~polykv.attention.signals.ATTENTION_INPUT`); else None."""

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
                        value=torch.cat([c.value for c in caps]), scaling=first.scaling, o_proj=first.o_proj,
                        attention_input=None if first.attention_input is None
                        else torch.cat([c.attention_input for c in caps]))


class Capture:
    """What the attach point hands every layer's keys to during a captured forward: records (query, key, value)
    of each layer in :attr:`found` and attends causally (no padding, no cache)."""

    def __init__(self, inputs: AttentionInputs | None = None):
        self.found: dict[int, LayerCapture] = {}
        self.inputs = inputs
        """The pre-hooks keeping each layer's attention input, when the capture keeps them."""

    def __call__(self, module, query, key, value, attention_mask, *, scaling: float, dropout: float = 0.0,
                 **kwargs):
        if query.shape[2] != key.shape[2]:
            raise ProfileError(f"layer {module.layer_idx}: capture expects a cache-free forward (query and key "
                               f"lengths {query.shape[2]} != {key.shape[2]})")
        self.found[module.layer_idx] = LayerCapture(
            layer_idx=module.layer_idx, query=query.detach(), key=key.detach(), value=value.detach(),
            scaling=float(scaling), o_proj=getattr(module, "o_proj", None),
            attention_input=None if self.inputs is None else self.inputs.held.pop(module.layer_idx))
        out = sdpa(query, key, value, scaling)                                    # (B, H, T, d)
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def capturing(model, attention_inputs: bool = False) -> Iterator[tuple[dict[int, LayerCapture], HandOverCache]]:
    """Within the block, a forward of ``model`` given the yielded cache (``use_cache=True``) fills the yielded
    dict {layer index: LayerCapture}; ``attention_inputs``: each capture keeps its layer's attention input too."""
    layers = int(model.config.get_text_config().num_hidden_layers)
    inputs = AttentionInputs(enumerate(attention_modules(model, layers))) if attention_inputs else None
    capture = Capture(inputs)
    with attached(model), (inputs.hooked() if inputs is not None else contextlib.nullcontext()):
        yield capture.found, HandOverCache(layers, capture)


@torch.no_grad()
def capture_sequence(model, input_ids: torch.Tensor, *, attention_inputs: bool = False) -> list[LayerCapture]:
    """Run one cache-free forward of ``input_ids`` [T] or [1, T]; return every layer's capture in order (with its
    attention input when ``attention_inputs``: for rules that read it).

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
    with capturing(model, attention_inputs) as (found, cache):
        model(input_ids=ids.to(device), use_cache=True, **{cache_keyword(model): cache})
    layers = int(model.config.get_text_config().num_hidden_layers)
    if sorted(found) != list(range(layers)):
        raise ProfileError(f"{type(model).__name__}: captured layers {sorted(found)}, expected 0..{layers - 1}; "
                           "calibration needs decoders whose attention uses the transformers AttentionInterface")
    return [found[i] for i in range(layers)]
