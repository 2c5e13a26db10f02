"""Prefill once, compress many ways: a snapshot of the raw prefill that any plan can be restored from.

Prefill attention runs on the raw prompt K/V before any eviction (see :mod:`polykv.runtime.layer_cache`),
so everything a prefill computes — hidden states, the raw post-RoPE keys and values of every layer,
the recent queries and the accumulated attention — is the same whatever the plan. Only what happens
after the last prefill forward depends on the plan: the prefill rule's selection, quantization, and
every later token. A study that runs many plans on one context therefore runs the model over the
context once (:func:`capture_prefill`) and restores each plan's cache from the snapshot
(:func:`restore_prefill`), which then selects and quantizes exactly as
:meth:`polykv.runtime.Session.prefill` would have.

The snapshot records the state of every rule (and allocator) of the plans it was captured for,
one object per distinct ``share_key`` (a query window of each length, accumulated attention once);
a plan restored from it gets copies of exactly the states its own prefill would have built.

One thing a plan does change during prefill: a layer whose states read every attention row (H2O's
column sums) attends in the one-pass signal kernel, others in SDPA (:func:`polykv.attention.attach.attend`);
the two agree to float rounding, not bit for bit. So plans are grouped by which layers take the
signal pass (their *attention signature*), the model runs over the prompt once per group, and each
plan is restored from its own group's prefill: still exactly its own ``Session.prefill``.
Shapes: B batch, H query heads, Hkv KV heads, T prompt tokens, d head dim.
"""

from __future__ import annotations

import copy
import inspect
from typing import Sequence

import attrs
import torch

from polykv.attention.signals import signal_request
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import Plan, full_plan
from polykv.runtime.cache import PlanCache
from polykv.runtime.calls import check_chunk_size
from polykv.runtime.layer_cache import new_states
from polykv.runtime.probe_pass import run_probe_chunks
from polykv.runtime import session as sessions  # sessions.apply: looked up when called, so it can be wrapped
from polykv.runtime.storage import StorageView


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
    states: dict
    """``share_key`` -> the rule state that observed the whole prompt."""
    scaling: float
    """Attention scaling the layer used."""


@attrs.define(frozen=True, kw_only=True)
class PrefillSnapshot:
    """Raw prefill of one prompt on one model: per attention signature (a tuple of one bool per layer,
    True where the layer attends in the signal pass), one :class:`LayerSnapshot` per layer."""

    variants: dict
    """(attention signature, probe key, ranks) -> tuple of :class:`LayerSnapshot` (one per layer); the probe key
    (:func:`probe_key`) is None for plans without a probe (:mod:`polykv.contract.probe`), the ranks
    (:func:`plan_ranks`) None for plans without low-rank layers (whose prefill attends in code space, so
    plans of other ranks prefill differently and keep apart; their snapshots hold the codes)."""
    input_ids: torch.Tensor
    """[B, T] the prompt that was prefilled."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def layers(self) -> tuple[LayerSnapshot, ...]:
        """The layers of the only variant (an error when plans of several signatures were captured)."""
        if len(self.variants) != 1:
            raise RuntimeConfigError(f"the snapshot holds {len(self.variants)} prefills (plans whose layers attend "
                                     f"differently); pick one with snapshot.variants[signature]")
        return next(iter(self.variants.values()))


def plan_states(session) -> list[list]:
    """Per layer, fresh states of every rule and allocator of ``session``'s plan."""
    out = []
    for spec in session.layer_specs:
        states = [st for st in new_states(spec).values() if st is not None]
        out.append(states)
    for group, allocator in session.allocation_groups:
        for layer in group.layers:
            st = allocator.new_state()
            if st is not None:
                out[layer].append(st)
    return out


def attention_signature(per_layer_states: Sequence[Sequence]) -> tuple[bool, ...]:
    """Per layer, whether its prefill attends in the signal pass (some state reads every attention row)."""
    return tuple(signal_request(states).needs_every_row for states in per_layer_states)


def _union(per_plan: Sequence[list[list]]) -> list[dict]:
    """Per layer, one state per distinct ``share_key`` over the plans' states."""
    union = [{} for _ in per_plan[0]]
    for per_layer in per_plan:
        for have, states in zip(union, per_layer):
            for st in states:
                if st.share_key is not None:
                    have.setdefault(st.share_key, st)
    return union


def plan_ranks(plan: Plan) -> tuple | None:
    """Per layer ``(k_rank, v_rank)`` of a plan with low-rank layers, else None."""
    return tuple((lp.k_rank, lp.v_rank) for lp in plan.layers) if plan.low_rank else None


def probe_key(chunks) -> tuple | None:
    """What identifies a probe (:mod:`polykv.contract.probe`) among a snapshot's prefills: its chunks' spans
    and token ids; None without one."""
    if not chunks:
        return None
    return tuple((c.span, tuple(c.ids.flatten().tolist())) for c in chunks)


def session_probe(session, input_ids: torch.Tensor) -> list:
    """The probe ``session``'s plan runs after ``input_ids`` (checked as the session checks it), or []."""
    return session.probe.chunks_for(input_ids) if session.probe is not None else []


def capture_groups(model, plans: Sequence[Plan], *, registry=None, input_ids: torch.Tensor | None = None,
                   model_data=None) -> dict[tuple, tuple[list[dict], list, dict]]:
    """(attention signature, probe key) -> (per layer, one fresh state per distinct ``share_key`` over the rules
    of the plans of that key; the probe's chunks). Validates each plan; a plan whose rules run a probe
    (built from ``input_ids``) gets its own prefill per distinct probe, since the probe's forwards are
    observed by its states. Also each key's per-model data (``model_data`` as :func:`polykv.apply` takes it)."""
    groups: dict[tuple, list] = {}
    probes: dict[tuple, list] = {}
    data: dict[tuple, dict] = {}
    for plan in plans:
        session = sessions.apply(model, plan, registry=registry, model_data=model_data)
        per_layer = plan_states(session)
        chunks = session_probe(session, input_ids) if input_ids is not None else []
        key = (attention_signature(per_layer), probe_key(chunks), plan_ranks(plan))
        groups.setdefault(key, []).append(per_layer)
        probes[key] = chunks
        data.setdefault(key, {}).update(session.model_data)
    if not groups:
        raise RuntimeConfigError("capture_prefill needs at least one plan to know which rule states to record")
    return {key: (_union(per_plan), probes[key], data[key]) for key, per_plan in groups.items()}


def _scaling(module, head_dim: int) -> float:
    return float(getattr(module, "scaling", head_dim ** -0.5))


def capture_prefill(model, input_ids: torch.Tensor, plans: Sequence[Plan], *, registry=None,
                    chunk_size: int | None = None, model_data=None) -> PrefillSnapshot:
    """Run the model over ``input_ids`` [B, T] and keep the raw K/V and signals of every layer: once per
    attention signature among ``plans`` (once when every plan's layers attend alike).

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
    model_data : mapping, optional
        Per-model data the plans read, as :func:`polykv.apply` takes it (e.g. the key/value bases of
        plans with ranks); what is not given is found or computed as ``apply`` does.
    """
    check_chunk_size(chunk_size, "capture_prefill")
    groups = capture_groups(model, plans, registry=registry, input_ids=input_ids, model_data=model_data)
    T = int(input_ids.shape[1])
    step = chunk_size or T
    full = full_plan(geometry_of_model(model))
    variants = {}
    for key, (states, chunks, data) in groups.items():  # the plans' model data: states may apply it as they observe
        ranks = key[2]
        run = sessions.apply(model, full if ranks is None else attrs.evolve(  # ranks: the prefill attends in codes
            full, layers=[attrs.evolve(lp, k_rank=k, v_rank=v) for lp, (k, v) in zip(full.layers, ranks)]),
            registry=registry, model_data=data)
        variants[key] = _capture_one(model, run, input_ids, states, step, chunks)
    return PrefillSnapshot(variants=variants, input_ids=input_ids)


def _capture_one(model, session, input_ids: torch.Tensor, states: list[dict], step: int, probe=()) -> tuple:
    """One prefill of ``input_ids`` observed by ``states`` (per layer), then the ``probe``'s forwards (their
    keys and values discarded, as in the runtime); its layer snapshots."""
    T = int(input_ids.shape[1])
    with torch.no_grad(), session:
        cache = session.new_cache()
        for layer, have in zip(cache.layers, states):
            layer.extra_states = list(have.values())
        session.attention_inputs.hook_readers(cache.layers)   # the recorded states that read the attention input
        cache.prefill_continues = True  # selection never runs: the raw K/V stay in each layer
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
        for start in range(0, T, step):  # only the cache matters: no vocabulary projection of every position
            model(input_ids[:, start:start + step], use_cache=True, **{session.cache_keyword: cache}, **keep)
        run_probe_chunks(model, model, cache, probe, input_ids.device, session.cache_keyword)
        layers = []
        for layer, module, have in zip(cache.layers, session.attention_modules, states):
            raw = layer.prompt
            layers.append(LayerSnapshot(keys=raw.keys, values=raw.values, positions=raw.positions,
                                        tokens_seen=layer.tokens_seen, states=have,
                                        scaling=_scaling(module, raw.keys.shape[-1])))
    return tuple(layers)


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
    some = next(iter(snapshot.variants.values()))
    if len(cache.layers) != len(some):
        raise RuntimeConfigError(f"the prefill snapshot has {len(some)} layers but the session's model "
                                 f"has {len(cache.layers)}; capture it on this model")
    signature = (attention_signature([layer.observing_states() for layer in cache.layers]),
                 probe_key(session_probe(session, snapshot.input_ids)), plan_ranks(session.plan))
    if signature not in snapshot.variants:
        raise RuntimeConfigError("the prefill snapshot holds no prefill whose layers attend as this plan's do (its "
                                 "rules' signal pass, probe or ranks differ from every captured plan's); pass this "
                                 "plan to "
                                 "capture_prefill(..., plans=[...])")
    for layer, snap in zip(cache.layers, snapshot.variants[signature]):
        copies: dict[int, object] = {}

        def restored(state, _snap=snap, _layer=layer):
            if state is None:
                return None
            if id(state) not in copies:
                found = _snap.states.get(state.share_key) if state.share_key is not None else None
                if found is None:
                    raise RuntimeConfigError(
                        f"layer {_layer.layer_idx}: the plan's rule state {type(state).__name__} (share_key "
                        f"{state.share_key!r}) was not recorded in the prefill snapshot; pass this plan to "
                        f"capture_prefill(..., plans=[...]) (a state needs a share_key to be reused)")
                copies[id(state)] = copy.deepcopy(found)
            return copies[id(state)]

        layer.states = {phase: restored(st) for phase, st in layer.states.items()}
        layer.extra_states = [restored(st) for st in layer.extra_states]
        run = layer.group
        if run is not None:
            run.states[layer.layer_idx] = layer.extra_states[0] if layer.extra_states else None
        layer.lazy_initialization(snap.keys, snap.values)
        layer.tokens_seen = snap.tokens_seen
        layer.scaling = snap.scaling
        layer.prompt = StorageView(keys=snap.keys, values=snap.values, positions=snap.positions, valid=None)
        layer.end_prefill()
    return cache


def forward(session, input_ids: torch.Tensor):
    """Run ``input_ids`` [B, q] through the model with the session's live cache (decode phase)."""
    if session.cache is None:
        raise RuntimeConfigError("the session has no cache yet: restore_prefill() or session.prefill() first")
    return session.model(input_ids, use_cache=True, **{session.cache_keyword: session.cache})
