"""Prefill once, compress many ways: a snapshot of the raw prefill that any plan can be restored from.

Prefill attention runs on the raw prompt K/V before any eviction (see :mod:`polykv.runtime.cache`),
so everything a prefill computes — hidden states, the raw post-RoPE keys and values of every layer,
the recent queries and the accumulated attention — is the same whatever the plan. Only what happens
after the last prefill forward depends on the plan: the prefill rule's selection, quantization, and
every later token. A study that runs many plans on one context therefore runs the model over the
context once (:func:`capture_prefill`) and restores each plan's cache from the snapshot
(:func:`restore_prefill`), which then selects and quantizes exactly as
:meth:`polykv.runtime.Session.prefill` would have.

The snapshot records the union of the signals the plans need (the longest query window of any of
their rules, accumulated attention if any rule needs it); a plan restored from it sees exactly the
signals its own prefill would have recorded. Shapes: B batch, H query heads, Hkv KV heads, T prompt
tokens, d head dim, w query window.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from polykv.errors import RuntimeConfigError
from polykv.plan import Plan
from polykv.runtime.cache import PlanCache
from polykv.runtime.signals import SignalNeeds, SignalState


@attrs.define(frozen=True, kw_only=True)
class LayerSnapshot:
    """The raw prefill state of one layer, before selection."""

    keys: torch.Tensor
    """[B, Hkv, T, d] post-RoPE prompt keys, compute dtype."""
    values: torch.Tensor
    """[B, Hkv, T, d] prompt values."""
    positions: torch.Tensor
    """[B, Hkv, T] int64 original positions (0..T-1)."""
    tokens_seen: int
    """T."""
    needs: SignalNeeds
    """Signals recorded (the union over the plans the snapshot was captured for)."""
    queries: torch.Tensor | None
    """[B, H, w, d] the last w prompt queries (w = needs.window), or None."""
    query_positions: torch.Tensor | None
    """[w] int64 positions of ``queries``."""
    accumulated: torch.Tensor | None
    """[B, Hkv, T] float32 column sums of the prompt's attention, or None."""
    scaling: float
    """Attention scaling the layer used."""


@attrs.define(frozen=True, kw_only=True)
class PrefillSnapshot:
    """Raw prefill of one prompt on one model: one :class:`LayerSnapshot` per layer."""

    layers: tuple[LayerSnapshot, ...]
    input_ids: torch.Tensor
    """[B, T] the prompt that was prefilled."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def signal_needs(model, plans: Sequence[Plan], *, registry=None) -> list[SignalNeeds]:
    """Per layer, the union of what the prefill of each plan in ``plans`` records (validates each plan)."""
    from polykv.runtime.session import apply

    union: list[SignalNeeds] | None = None
    for plan in plans:
        specs = apply(model, plan, registry=registry)._specs
        needs = [s.prefill_needs for s in specs]
        if union is None:
            union = needs
        else:
            union = [SignalNeeds(window=max(a.window, b.window), accumulated=a.accumulated or b.accumulated)
                     for a, b in zip(union, needs)]
    if union is None:
        raise RuntimeConfigError("capture_prefill needs at least one plan to know which signals to record")
    return union


def _scaling(module, head_dim: int) -> float:
    return float(getattr(module, "scaling", head_dim ** -0.5))


def capture_prefill(model, input_ids: torch.Tensor, plans: Sequence[Plan], *, registry=None,
                    chunk_size: int | None = None) -> PrefillSnapshot:
    """Run the model once over ``input_ids`` [B, T] and keep the raw K/V and signals of every layer.

    Parameters
    ----------
    model
        A transformers decoder the runtime serves (see :func:`polykv.apply`).
    input_ids : torch.Tensor
        [B, T] prompt tokens (no padding).
    plans : sequence of Plan
        The plans that will be restored from the snapshot; they decide which signals are recorded.
    chunk_size : int, optional
        Prefill in chunks of this many tokens (the same selection as one forward, like
        :meth:`Session.prefill`).
    """
    from polykv.plan import full_plan
    from polykv.geometry import geometry_of_model
    from polykv.runtime.session import apply

    needs = signal_needs(model, plans, registry=registry)
    session = apply(model, full_plan(geometry_of_model(model)), registry=registry)
    T = int(input_ids.shape[1])
    step = chunk_size or T
    if step < 1:
        raise RuntimeConfigError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    with torch.no_grad(), session:
        cache = session.new_cache()
        for layer, need in zip(cache.layers, needs):
            layer.signals = SignalState(needs=need)
        cache.prefill_continues = True  # selection never runs: the raw K/V stay in each layer
        for start in range(0, T, step):
            model(input_ids[:, start:start + step], use_cache=True, **{session._cache_kw: cache})
        layers = []
        for layer, module in zip(cache.layers, session._modules):
            sig = layer.signals
            layers.append(LayerSnapshot(
                keys=layer._raw_k, values=layer._raw_v, positions=layer.positions, tokens_seen=layer.tokens_seen,
                needs=sig.needs, queries=sig.queries, query_positions=sig.query_positions,
                accumulated=sig.accumulated, scaling=_scaling(module, layer._raw_k.shape[-1])))
    return PrefillSnapshot(layers=tuple(layers), input_ids=input_ids)


def restore_prefill(session, snapshot: PrefillSnapshot) -> PlanCache:
    """Give the active ``session`` a fresh cache holding ``snapshot`` compressed by the session's plan.

    The result equals ``session.prefill(snapshot.input_ids)``: the plan's prefill rule selects from the
    raw K/V with the same signals, the kept tokens are quantized, and the cache is ready for decode.

    Raises
    ------
    RuntimeConfigError
        The snapshot has another layer count, or lacks a signal the plan's rules need (capture it
        with this plan among ``plans``).
    """
    cache = session.new_cache()
    session.note_context(snapshot.tokens)
    if len(cache.layers) != len(snapshot.layers):
        raise RuntimeConfigError(f"the prefill snapshot has {len(snapshot.layers)} layers but the session's model "
                                 f"has {len(cache.layers)}; capture it on this model")
    for layer, snap in zip(cache.layers, snapshot.layers):
        need = layer.spec.prefill_needs
        if need.window > snap.needs.window or (need.accumulated and not snap.needs.accumulated):
            raise RuntimeConfigError(
                f"layer {layer.layer_idx}: the plan needs {need} but the prefill snapshot recorded {snap.needs}; "
                f"pass this plan to capture_prefill(..., plans=[...]) so its signals are recorded")
        layer.lazy_initialization(snap.keys, snap.values)
        layer.tokens_seen = snap.tokens_seen
        layer.positions = snap.positions
        layer._raw_k, layer._raw_v = snap.keys, snap.values
        sig = SignalState(needs=need)
        if need.window:
            sig.queries = snap.queries[:, :, -need.window:].contiguous()
            sig.query_positions = snap.query_positions[-need.window:]
        if need.accumulated:
            sig.accumulated = snap.accumulated
        layer.signals = sig
        layer._finish_prefill(snap.scaling)
    return cache


def forward(session, input_ids: torch.Tensor):
    """Run ``input_ids`` [B, q] through the model with the session's live cache (decode phase)."""
    if session.cache is None:
        raise RuntimeConfigError("the session has no cache yet: restore_prefill() or session.prefill() first")
    return session.model(input_ids, use_cache=True, **{session._cache_kw: session.cache})
