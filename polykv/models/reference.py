"""The masked full-cache reference: what a compressed plan's run must equal, computed without any cache.

A run under a plan is recorded forward by forward: before each forward, the original positions every
layer and KV head stores. The reference then runs the whole token sequence once through the same model
with no cache and an eager attention whose mask lets each query row see exactly

* during prefill, the causal prompt (prefill attends the raw prompt);
* afterwards, the positions stored before its forward plus the forward's own causal new tokens;

intersected, on sliding-window and chunked layers, with the model's own window (or chunk). The
reference attention reproduces the model's attention variant (logit softcapping, learned sinks) from
the arguments the model passes, so the two runs differ only in how the cache is kept.

>>> run = record_run(model, plan, prompt_ids, continuation=question_ids, steps=8)   # doctest: +SKIP
>>> (run.logits - masked_reference_logits(model, run)).abs().max()                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from polykv.attention.attach import HandOverCache, attached
from polykv.attention.signals import chunked_attention
from polykv.runtime.cache import cache_keyword
from polykv.runtime.session import apply


@attrs.define(frozen=True)
class RecordedRun:
    """A plan's run: every token fed, the logits of every position, what each layer stored per forward."""

    tokens: torch.Tensor
    """[B, N] every token fed (prompt, continuation, greedy steps)."""
    logits: torch.Tensor
    """[B, N, vocab] the logits the run produced for every fed position."""
    forwards: tuple
    """Per forward ``(stored, start, stop)``: ``stored`` a list of [B, Hkv, T] positions per layer before
    the forward (None for the prefill), the forward covering positions ``start .. stop - 1``."""
    geometry: Any
    """:class:`polykv.models.geometry.ModelGeometry` of the model."""
    allocations: dict = attrs.field(factory=dict)
    """``PlanCache.allocations()`` at the end of the run (allocated layers only)."""
    head_counts: list = attrs.field(factory=list)
    """``PlanCache.head_counts()`` at the end of the run: tokens stored per layer, batch row and KV head."""
    low_rank: dict = attrs.field(factory=dict)
    """Per layer with a rank, its :class:`~polykv.attention.low_rank.LowRank` bases: the reference attends the
    reconstructions ``P P^T k`` and ``U U^T v`` (what code-space attention computes)."""


def record_run(model, plan, prompt: torch.Tensor, *, continuation: torch.Tensor | None = None, steps: int = 8,
               model_data: Mapping[str, Any] | None = None) -> RecordedRun:
    """Prefill ``prompt``, feed ``continuation`` in one forward (if given), then ``steps`` greedy tokens."""
    forwards, logits, fed = [], [], [prompt]
    with torch.no_grad(), apply(model, plan, model_data=model_data) as session:
        cache = session.new_cache()
        out = model(prompt, use_cache=True, **{session.cache_keyword: cache})
        forwards.append((None, 0, prompt.shape[1]))
        logits.append(out.logits)
        for chunk in ([continuation] if continuation is not None else []) + [None] * steps:
            if chunk is None:
                chunk = out.logits[:, -1:].argmax(-1)
            start = cache.get_seq_length()
            stored = [layer.positions.clone() for layer in cache.layers]
            out = model(chunk, use_cache=True, **{session.cache_keyword: cache})
            forwards.append((stored, start, start + chunk.shape[1]))
            logits.append(out.logits)
            fed.append(chunk)
        geometry = session.geometry
        allocations, head_counts = cache.allocations(), cache.head_counts()
        low_rank = {i: layer.spec.low_rank for i, layer in enumerate(cache.layers) if layer.spec.low_rank is not None}
    return RecordedRun(tokens=torch.cat(fed, dim=1), logits=torch.cat(logits, dim=1), forwards=tuple(forwards),
                       geometry=geometry, allocations=allocations, head_counts=head_counts, low_rank=low_rank)


def visibility_masks(run: RecordedRun) -> dict[int, torch.Tensor]:
    """Per layer the [B, Hkv, N, N] bool mask of :func:`masked_reference_logits` (True = may attend)."""
    geo = run.geometry
    B, N = run.tokens.shape
    rows = torch.arange(N)
    masks = {}
    for layer in range(geo.num_layers):
        allowed = torch.zeros(B, geo.num_kv_heads, N, N, dtype=torch.bool)
        for stored, a, b in run.forwards:
            causal = (rows[a:b, None] >= rows[None, :]) & (rows[None, :] >= a)
            allowed[:, :, a:b] = causal
            if stored is not None:
                kept = stored[layer]                                   # -1 marks a ragged layer's padding
                seen = torch.zeros(B, geo.num_kv_heads, N, dtype=torch.long)
                seen.scatter_add_(-1, kept.clamp_min(0), (kept >= 0).long())
                seen = seen > 0
                allowed[:, :, a:b, :a] = seen[:, :, None, :a]
        if geo.is_windowed(layer):
            q, k = rows[:, None], rows[None, :]
            w = int(geo.sliding_window)
            allowed &= (k // w == q // w) if geo.layer_types[layer] == "chunked_attention" else (k > q - w)
        masks[layer] = allowed
    return masks


class ReferenceAttend:
    """Eager attention under per-layer, per-KV-head masks ``allowed`` [B, Hkv, N, N], with the model's softcap
    and sinks; a layer with bases attends the reconstructions (what attention over the codes must equal)."""

    def __init__(self, allowed: dict[int, torch.Tensor], low_rank: dict):
        self.allowed, self.low_rank = allowed, low_rank

    def __call__(self, module, query, key, value, attention_mask, *, scaling: float, dropout: float = 0.0,
                 **kwargs):
        low_rank = self.low_rank.get(module.layer_idx)
        if low_rank is not None:
            key, value = low_rank.to(key.device, key.dtype).reconstruct(key, value)
        out = chunked_attention(query, key, value, scaling, visible=self.allowed[module.layer_idx],
                                softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux", kwargs.get("sinks")),
                                eager=True)
        return out.transpose(1, 2).contiguous(), None


def masked_reference_logits(model, run: RecordedRun) -> torch.Tensor:
    """[B, N, vocab] logits of one cache-free forward over ``run.tokens`` under :func:`visibility_masks`."""
    attend = ReferenceAttend(visibility_masks(run), dict(run.low_rank))
    cache = HandOverCache(run.geometry.num_layers, attend)
    with torch.no_grad(), attached(model):
        return model(run.tokens, use_cache=True, **{cache_keyword(model): cache}).logits
