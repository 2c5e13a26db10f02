"""Model geometry: the shape facts of a decoder that plans, memory and the runtime depend on.

Built from any transformers decoder config (Llama, Qwen2, Qwen3, Mistral, Gemma 3, ...). The
fingerprint ties plans and profiles to one model: a digest of the config's shape fields plus,
when weights are given, a digest of the weights that does not depend on the compute dtype (see
:func:`weights_digest`), so one profile and its plans serve float32, bfloat16 and float16 runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
WINDOWED = (SLIDING, CHUNKED)
"""Layer types whose attention sees a bounded span of recent tokens (see :meth:`ModelGeometry.token_bound`)."""


@attrs.define(frozen=True, kw_only=True)
class ModelGeometry:
    """Shape of a decoder's attention stack."""

    model_type: str
    """transformers ``model_type`` (e.g. ``"llama"``)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA groups)."""
    head_dim: int
    """Per-head dimension d."""
    rope_theta: float | None
    """RoPE base of the full-attention layers (None when unknown)."""
    rope_type: str = "default"
    """transformers rope_type (``default``, ``llama3``, ``yarn``, ...)."""
    max_positions: int | None = None
    """``max_position_embeddings``."""
    layer_types: tuple[str, ...] = ()
    """Per layer ``"full_attention"``, ``"sliding_attention"`` (a query sees the ``sliding_window`` newest
    positions, itself included) or ``"chunked_attention"`` (a query sees the earlier positions of its own
    chunk of ``sliding_window`` positions, Llama 4). Any other transformers layer type (linear attention,
    Mamba, ...) is kept verbatim."""
    sliding_window: int | None = None
    """Window of the sliding layers, or chunk size of the chunked layers (None when there are none)."""
    fingerprint: str | None = None
    """Identity of the model (config digest, plus weights digest when known)."""

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_windowed(self, layer: int) -> bool:
        """True for a sliding-window or chunked layer: its attention never looks further back than a window."""
        return bool(self.layer_types) and self.layer_types[layer] in WINDOWED

    def token_bound(self, layer: int) -> int | None:
        """Most tokens a layer ever needs to keep between forwards (None: unbounded, a full-attention layer).

        A sliding layer with window W keeps the W - 1 newest tokens (the next query sees those and
        itself); a chunked layer with chunk C keeps at most the C - 1 earlier tokens of the current chunk.
        """
        if not self.is_windowed(layer):
            return None
        return max(1, int(self.sliding_window) - 1)

    def windowed_layers(self) -> list[int]:
        """Indices of the sliding-window and chunked layers."""
        return [i for i in range(self.num_layers) if self.is_windowed(i)]

    def full_cache_bytes(self, tokens: int, *, batch: int = 1, dtype_bytes: int = 2) -> int:
        """Bytes of the uncompressed K+V cache vanilla transformers holds after ``tokens`` tokens: every
        full-attention layer holds them all, a windowed layer at most its :meth:`token_bound`."""
        held = sum(tokens if self.token_bound(i) is None else min(tokens, self.token_bound(i))
                   for i in range(self.num_layers))
        return 2 * held * batch * self.num_kv_heads * self.head_dim * dtype_bytes

    def summary(self) -> dict[str, Any]:
        return attrs.asdict(self)


def geometry_from_config(config: Any, *, weights_digest: str | None = None) -> ModelGeometry:
    """Geometry of a transformers decoder config (the text config of multimodal wrappers)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    if getattr(cfg, "multi_query", False) is True:  # GPT-BigCode: one K/V head whatever else the config says
        n_kv = 1
    else:
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and FULL in rope:  # per-layer-type rope (Gemma 3)
        rope = rope[FULL]
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None)) if isinstance(rope, dict) else None
    rope_type = (rope.get("rope_type") if isinstance(rope, dict) else None) or "default"
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = [SLIDING if window else CHUNKED if chunk else FULL] * n_layers
    types = tuple(str(t) for t in types)
    if SLIDING in types and CHUNKED in types and window != chunk:
        raise ValueError(f"{getattr(cfg, 'model_type', 'this model')}: sliding-window layers (window {window}) and "
                         f"chunked layers (chunk {chunk}) in one model are not supported")
    if CHUNKED in types:
        window = chunk
    elif SLIDING not in types:
        window = None
    geo = ModelGeometry(
        model_type=str(getattr(cfg, "model_type", "unknown")),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(head_dim),
        rope_theta=float(theta) if theta is not None else None,
        rope_type=str(rope_type),
        max_positions=getattr(cfg, "max_position_embeddings", None),
        layer_types=types,
        sliding_window=window,
    )
    return attrs.evolve(geo, fingerprint=fingerprint(geo, weights_digest))


WEIGHTS_TAG = "s"
"""Tag of the weights part of a fingerprint (``+s-<12 hex>``): a digest of weight sign bits."""
LEGACY_WEIGHTS_TAG = "w"
"""Tag written by polykv 0.1 (``+w-``): a digest of float32 weight values, which depended on the dtype."""


def fingerprint(geo: ModelGeometry, weights_digest: str | None = None) -> str:
    """``cfg-<12 hex>`` from the shape fields, ``+s-<12 hex>`` appended when weights are known."""
    shape = attrs.asdict(geo)
    shape.pop("fingerprint", None)
    text = json.dumps(shape, sort_keys=True, default=str)
    out = "cfg-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    if weights_digest:
        out += f"+{WEIGHTS_TAG}-" + weights_digest[:12]
    return out


def weights_digest(model: Any, *, max_values: int = 4096) -> str:
    """Digest of a model's weights that is the same in every compute dtype.

    For every named parameter (sorted by name): its name, its shape and the sign bits of its first
    ``max_values`` values. Casting a float to float32, bfloat16 or float16 (round to nearest) never
    changes its sign bit, not even when the value underflows to zero, so a model loaded in any of
    those dtypes from the same checkpoint gets the same digest; different weights flip some of the
    ~10^5-10^6 digested signs. (Digesting rounded values instead cannot be exact: a float32 weight
    rounds to float16 and bfloat16 differently.)
    """
    import numpy as np
    import torch

    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        t = param.detach().reshape(-1)[:max_values].to("cpu")
        if t.dtype.is_floating_point:
            bits = torch.signbit(t.float()).numpy()
        else:
            bits = (t < 0).numpy()
        h.update(f"{name}:{list(param.shape)}".encode())
        h.update(np.packbits(bits).tobytes())
    return h.hexdigest()


def geometry_of_model(model: Any) -> ModelGeometry:
    """Geometry plus a weights-aware fingerprint of a loaded transformers model."""
    return geometry_from_config(model.config, weights_digest=weights_digest(model))


def fingerprints_match(a: str | None, b: str | None) -> bool:
    """True unless both are known and differ.

    A config-only fingerprint matches any weights suffix, and so does a legacy ``+w-`` suffix
    against a current ``+s-`` one (the two digests cannot be compared: only the shapes are).
    """
    if not a or not b:
        return True
    if a == b:
        return True
    ca, cb = a.split("+", 1)[0], b.split("+", 1)[0]
    if ca != cb:
        return False
    if "+" not in a or "+" not in b:
        return True
    return _weights_tag(a) != _weights_tag(b)


def _weights_tag(fp: str) -> str:
    return fp.split("+", 1)[1].split("-", 1)[0]


def rope_of_model(model: Any) -> tuple[Any, float]:
    """The model's RoPE inverse frequencies ([d/2] float32, from its rotary embedding module) and its
    attention scaling, or ``(None, 1.0)`` for a model without one; the runtime and calibration both
    read them here, so a rule sees the same frequencies in both."""
    import torch

    for m in model.modules():
        inv = getattr(m, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and type(m).__name__.endswith("RotaryEmbedding"):
            return inv.detach().float(), float(getattr(m, "attention_scaling", 1.0) or 1.0)
    return None, 1.0
