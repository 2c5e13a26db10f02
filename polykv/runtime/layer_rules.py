"""A layer's rules at work: their states, what they observe, and one checked selection
(:class:`LayerRules`, one per :class:`~polykv.runtime.layer_cache.LayerCache`).

A selection runs the phase's rule on a view of the layer's tokens through a
:class:`~polykv.contract.rules.SelectionContext` (the state's built-in helpers as ``queries`` and
``accumulated``), checks it (:func:`~polykv.runtime.plugin_results.checked_selection`) and lets every observing state
gather with it, so the states keep following the kept tokens. :func:`over_budget` says when a layer holds more
than its budget. Shapes: B batch, Hkv KV heads, T tokens.
"""

from __future__ import annotations

import torch

from polykv.runtime.plugin_results import checked_selection
from polykv.contract.rules import SelectionContext
from polykv.contract.selection import Selection
from polykv.contract.state import AccumulatedAttention, Observation, QueryWindow, state_bytes
from polykv.errors import RuntimeConfigError
from polykv.runtime.layer_spec import CacheSettings, LayerSpec
from polykv.runtime.storage import StorageView


class LayerRules:
    """The rule objects of one layer (from its :class:`LayerSpec`), their states and the extra states (an
    allocator's, a prefill capture's) that observe the same forwards."""

    def __init__(self, layer_idx: int, spec: LayerSpec, settings: CacheSettings):
        self.layer_idx, self.spec, self.settings = layer_idx, spec, settings
        self.states = spec.new_states()
        """``{"prefill": RuleState | None, "decode": RuleState | None}`` (one object when shared)."""
        self.extra_states: list = []
        """More states observing this layer (an allocator's, a prefill capture's)."""

    def observing(self) -> list:
        """Every distinct state that observes this layer's forwards."""
        out = []
        for st in [self.states["prefill"], self.states["decode"], *self.extra_states]:
            if st is not None and all(st is not o for o in out):
                out.append(st)
        return out

    def observe(self, states, obs: Observation) -> None:
        for st in states:
            st.observe(obs)

    def prompt_stored(self) -> None:
        """The prompt is stored: only the decode rule's state stays."""
        dec = self.states["decode"]
        if dec is not None:
            dec.after_prefill()
        self.states = {"prefill": None, "decode": dec}
        self.extra_states = []

    def gather(self, sel: Selection) -> None:
        """Every observing state follows ``sel`` (the kept tokens)."""
        for st in self.observing():
            st.gather(sel)

    def context(self, phase: str, view: StorageView, state, *, tokens_seen: int, scaling: float | None,
                values: bool, head_capacity=None) -> SelectionContext:
        """The SelectionContext of ``view``: ``state`` as ``ctx.state``, and the built-in helpers it
        contains as ``queries``/``query_positions`` and ``accumulated``/``query_counts``."""
        settings = self.settings
        window = state.component(QueryWindow) if state is not None else None
        acc = state.component(AccumulatedAttention) if state is not None else None
        return SelectionContext(
            layer_idx=self.layer_idx, phase=phase, keys=view.keys, positions=view.positions,
            tokens_seen=tokens_seen, scaling=scaling,
            queries=window.queries if window is not None else None,
            query_positions=window.positions if window is not None else None,
            values=view.values if values else None,
            accumulated=acc.sums if acc is not None else None,
            query_counts=acc.query_counts(view.positions) if acc is not None else None,
            rope_inv_freq=settings.rope_inv_freq, rope_scaling=settings.rope_scaling, model_data=settings.model_data,
            generator=settings.generator, state=state, valid=view.valid, head_capacity=head_capacity,
            checks=settings.check)

    def select(self, phase: str, capacity: int, view: StorageView, *, tokens_seen: int, scaling: float | None,
               head_capacity: torch.Tensor | None = None) -> Selection:
        """Run the ``phase`` rule on ``view``; check its selection; gather every observing state; return it."""
        rule = self.spec.prefill_rule if phase == "prefill" else self.spec.decode_rule
        B, Hkv, _ = view.positions.shape
        ctx = self.context(phase, view, self.states[phase], tokens_seen=tokens_seen, scaling=scaling,
                           values=rule.needs_values,
                           head_capacity=None if head_capacity is None
                           else head_capacity.to(view.positions.device).expand(B, Hkv))
        op = getattr(self.spec.plan, phase)
        check = getattr(rule, "check_capacity", None)
        if check is not None and head_capacity is None:  # a capacity resolved from a ratio: known only now
            try:
                check(int(capacity))
            except ValueError as exc:
                ratio = "" if op.capacity_ratio is None else \
                    f" (capacity_ratio {op.capacity_ratio:g} of {tokens_seen} tokens)"
                raise RuntimeConfigError(f"layer {self.layer_idx} ({phase}): {exc}{ratio}") from None
        sel = checked_selection(rule.select(ctx, capacity), ctx, capacity,
                                where=f"layer {self.layer_idx} ({phase}): rule '{op.rule}'")
        self.gather(sel)
        return sel

    def state_bytes(self) -> dict[str, int]:
        return state_bytes(self.observing())


def over_budget(totals: list[int], Hkv: int, capacity: int, head_capacity: torch.Tensor | None, slack: int) -> bool:
    """True when some batch row stores more than the layer's budget: ``(capacity + slack) * Hkv`` tokens over
    its KV heads (the per-head budgets' sum + ``slack * Hkv`` when an allocator gave them); ``totals``: tokens
    each batch row stores over its heads. With every head holding the same count this is "some head holds more
    than capacity + slack"."""
    budget = capacity * Hkv if head_capacity is None else int(head_capacity.sum())
    return any(t > budget + slack * Hkv for t in totals)
