"""Layer-local error of the low-rank axis: one layer's attention output with key/value codes of given ranks.

For a captured sequence (:mod:`polykv.profiling.capture`) of T tokens, split into a prefix of P tokens
and F = T - P follow-up tokens, each candidate ``(k_rank, v_rank)`` is run through the runtime's own
code: the runtime's layer (:func:`polykv.runtime.layers.build_layer`) of a plan layer with the candidate's ranks
(and bit widths) and the model's bases takes the prefix as a prefill (projected as the runtime projects it,
stored in the quantizer's stores), then the follow-up keys and values are appended and the follow-up
queries attend the stores in code space exactly as a model's forward does (:func:`polykv.runtime.layers.forward_layer`:
``P^T q`` against the codes, the weighted codes lifted by ``U``). Error:
``||o_r - o_full||_F / ||o_full||_F`` of the follow-up output [B, H, F, d] (before ``o_proj``) against full
width, full precision: MoE-nD's sensitivity (:mod:`polykv.profiling.sensitivity`) for the rank axis,
one value per candidate, lower is better, for a solver to route ranks per layer.

Shapes: B sequences, H query heads, Hkv KV heads, P prefix, F follow-up, d head dim.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan import DEFAULT_QUANTIZER, LayerPlan
from polykv.profiling.capture import LayerCapture
from polykv.profiling.sensitivity import full_reference, relative_error
from polykv.registry import get_registry
from polykv.runtime.layers import build_layer, forward_layer


def rank_candidates(head_dim: int, fractions: Sequence[float] = (1.0, 0.75, 0.5, 0.25), *,
                    multiple: int = 16) -> list[int]:
    """Ranks ``fraction * head_dim`` rounded to a multiple of ``multiple`` (at least ``multiple``, at most d), distinct,
    largest first: the candidates ALGORITHMS-3 suggests (d, 3d/4, d/2, d/4 rounded to 16)."""
    out = []
    for f in fractions:
        r = min(head_dim, max(multiple, int(round(f * head_dim / multiple)) * multiple))
        if r not in out:
            out.append(r)
    return out


@torch.no_grad()
def layer_rank_errors(cap: LayerCapture, prefix: int, candidates: Sequence[tuple[int | None, int | None]], bases: Any,
                      *, registry: Any = None, k_bits: int = 16, v_bits: int = 16, quantizer: str = DEFAULT_QUANTIZER,
                      quantizer_params: dict | None = None, reference: torch.Tensor | None = None) -> list[float]:
    """Relative error of the layer's follow-up attention output under each ``(k_rank, v_rank)`` (None: full width),
    at ``k_bits`` / ``v_bits`` (module docstring); one value per candidate.

    ``bases``: the model's :class:`~polykv.models.kv_bases.KVBases`. ``reference``: the full-precision follow-up
    output [B, H, F, d] (computed when None)."""
    if registry is None:
        registry = get_registry()
    T, d = cap.num_tokens, cap.key.shape[-1]
    if not 0 < prefix < T:
        raise ValueError(f"layer {cap.layer_idx}: prefix {prefix} must lie strictly inside the {T}-token sequence")
    ref = full_reference(cap, prefix) if reference is None else reference
    out = []
    for k_rank, v_rank in candidates:
        for name, rank in (("k_rank", k_rank), ("v_rank", v_rank)):
            if rank is not None and not 1 <= rank <= d:
                raise ValueError(f"layer {cap.layer_idx}: candidate {name} {rank} must lie in 1..{d} (the head dim), "
                                 f"or be None for full width")
        lp = LayerPlan(layer=cap.layer_idx, k_bits=k_bits, v_bits=v_bits, quantizer=quantizer,
                       quantizer_params=dict(quantizer_params or {}), k_rank=k_rank, v_rank=v_rank)
        o = followup_in_code_space(cap, prefix, lp, bases, registry)
        out.append(relative_error(o, ref))
    return out


def followup_in_code_space(cap: LayerCapture, prefix: int, lp: LayerPlan, bases: Any, registry: Any) -> torch.Tensor:
    """[B, H, F, d] the follow-up queries' attention output over a one-layer cache of plan layer ``lp`` that took
    the prefix as its prompt and the follow-up as one more forward (the runtime's projection, stores and attention)."""
    layer = build_layer(lp, registry, model_data={KV_BASES_KEY: bases} if lp.low_rank else None)
    o = None
    for start, stop in ((0, prefix), (prefix, cap.num_tokens)):
        o = forward_layer(layer, cap.key[:, :, start:stop], cap.value[:, :, start:stop],
                          cap.query[:, :, start:stop], cap.scaling)
    return o
