"""How a layer cache selects, stores and evicts (:class:`LayerSelection`, a base of
:class:`~polykv.runtime.layer_cache.LayerCache`).

Prefill: once the prompt is complete (:meth:`LayerSelection.end_prefill`) a windowed layer keeps each
head's newest tokens within its bound, then the prefill rule selects from the prompt
(:meth:`LayerSelection.select_prompt`, merging, when its selection says so, in full precision) and only the
survivors are appended to the stores (:meth:`LayerSelection.store_prompt`; quantization happens after
eviction and merging). A layer in an allocation group waits for its allocator
(:mod:`polykv.runtime.allocation`), which calls the same two steps. Decode (:meth:`LayerSelection._maybe_evict`,
after each forward): a windowed layer drops what falls out of its bound; once some head stores more than its
capacity + ``decode_slack`` the decode rule selects and the storage evicts; a merge is written into the stores
(:meth:`KVStore.write`) before the gather. Every selection is checked
(:func:`~polykv.runtime.plugin_results.checked_selection`) and every observing state gathers with it.

Shapes: B batch, Hkv KV heads, T stored tokens, d head dim.
"""

from __future__ import annotations

import torch

from polykv.runtime.plugin_results import checked_selection
from polykv.contract.rules import SelectionContext
from polykv.contract.selection import Selection, ragged_top_k
from polykv.contract.state import AccumulatedAttention, QueryWindow
from polykv.errors import RuntimeConfigError
from polykv.runtime.layer_spec import ForwardStep
from polykv.runtime.storage import StorageView


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` [B, Hkv, T, w] at token ``index`` [B, Hkv, n]: [B, Hkv, n, w] (keys and values may differ in w)."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


class LayerSelection:
    """Selection, storing and eviction of a :class:`~polykv.runtime.layer_cache.LayerCache`, on the layer's own
    fields (``spec``, ``settings``, ``storage``, ``prompt``, ``states``, ``budget``, ``tokens_seen``, ...)."""

    def end_prefill(self) -> None:
        """The prompt is complete: select and store now, or hand the layer to its allocation group."""
        bound = self.spec.token_bound
        if bound is not None and self.prompt.positions.shape[-1] > bound:
            self.prompt = self._keep_newest(self.prompt, bound)
        if self.group is not None:
            self.group.layer_done(self)
            return
        self.select_prompt(self.spec.plan.prefill.resolve_capacity(self.tokens_seen))
        self.store_prompt()

    def select_prompt(self, capacity: int | None, head_capacity: torch.Tensor | None = None) -> None:
        """Run the prefill rule on the (raw or already selected) prompt when some head exceeds its budget."""
        rule, raw = self.spec.prefill_rule, self.prompt
        if rule is None or capacity is None:
            return
        if not self._over_budget(capacity, head_capacity, 0):
            return
        sel = self.select(rule, "prefill", capacity, raw, head_capacity)
        keys, values = raw.keys, raw.values
        if sel.merge is not None:
            keys = sel.merge.apply(keys)[0] if "key" in sel.merge.streams else keys
            values = sel.merge.apply(values)[0] if "value" in sel.merge.streams else values
        idx = sel.index
        valid = sel.kept_mask() if sel.ragged else None
        positions = raw.positions.gather(-1, idx)
        if valid is not None:
            positions = positions.masked_fill(~valid, -1)
        self.prompt = StorageView(keys=_gather_tokens(keys, idx), values=_gather_tokens(values, idx),
                                  positions=positions, valid=valid)

    def store_prompt(self) -> None:
        """Move the (selected) prompt into the stores; only the decode rule's state stays."""
        raw = self.prompt
        counts = raw.valid.sum(-1) if raw.valid is not None else None
        self.storage.fill(raw.keys, raw.values, raw.positions, counts)
        if self.share_lower is not None:
            plan = self.spec.plan
            self.storage.share_prompt(self.share_lower.storage, held_dtype=self.settings.storage_dtype or self.dtype,
                                      compute_dtype=self.dtype, **plan.share_params)
        self.prompt = None
        pre, dec = self.states["prefill"], self.states["decode"]
        if dec is not None:
            dec.after_prefill()
        self.states = {"prefill": None, "decode": dec}
        self.extra_states = []
        self.prefilled = True
        del pre

    def _keep_newest(self, view: StorageView, bound: int) -> StorageView:
        """A windowed layer's own bound: keep each head's ``bound`` newest tokens of ``view`` (every older one
        is outside the window of every later query). Observing states follow; returns the prompt view it
        leaves (prefill) or evicts from the storage (decode) and returns the storage's new view."""
        counts = view.valid.sum(-1) if view.valid is not None else None
        if counts is None:
            T = view.positions.shape[-1]
            index = torch.arange(T - bound, T, device=view.positions.device).expand(*view.positions.shape[:2], bound)
            sel = Selection(index=index.contiguous())
        else:
            scores = view.positions.masked_fill(~view.valid, -1).to(torch.float64)
            sel = ragged_top_k(scores, counts.clamp(max=bound))
        for st in self.observing_states():
            st.gather(sel)
        if not self.prefilled:
            return StorageView(keys=_gather_tokens(view.keys, sel.index), values=_gather_tokens(view.values, sel.index),
                               positions=view.positions.gather(-1, sel.index), valid=None)
        self.storage.evict(sel, view)
        return self.storage.view()

    def _maybe_evict(self, step: ForwardStep) -> None:
        view = step.view
        bound = self.spec.token_bound
        if bound is not None and self.storage.width() > bound:
            view = self._keep_newest(view, bound)
        rule = self.spec.decode_rule
        if rule is None:
            return
        head_cap = self.budget if isinstance(self.budget, torch.Tensor) else None
        if self.budget is not None:
            cap = int(self.budget.max()) if head_cap is not None else int(self.budget)
        else:
            cap = self.spec.plan.decode.resolve_capacity(self.tokens_seen)
        if cap is None:
            return
        if not self._over_budget(cap, head_cap, self.settings.decode_slack):
            return
        if step.stores is not None:  # the stores were read: build the view to select
            view = self.storage.view()
        sel = self.select(rule, "decode", cap, view, head_cap)
        self.storage.evict(sel, view)

    def context(self, phase: str, view: StorageView, state, *, values: bool, head_capacity=None) -> SelectionContext:
        """The SelectionContext of ``view``: ``state`` as ``ctx.state``, and the built-in helpers it
        contains as ``queries``/``query_positions`` and ``accumulated``/``query_counts``."""
        settings = self.settings
        window = state.component(QueryWindow) if state is not None else None
        acc = state.component(AccumulatedAttention) if state is not None else None
        return SelectionContext(
            layer_idx=self.layer_idx, phase=phase, keys=view.keys, positions=view.positions,
            tokens_seen=self.tokens_seen, scaling=self.scaling,
            queries=window.queries if window is not None else None,
            query_positions=window.positions if window is not None else None,
            values=view.values if values else None,
            accumulated=acc.sums if acc is not None else None,
            query_counts=acc.query_counts(view.positions) if acc is not None else None,
            rope_inv_freq=settings.rope_inv_freq, rope_scaling=settings.rope_scaling, model_data=settings.model_data,
            generator=settings.generator, state=state, valid=view.valid, head_capacity=head_capacity,
            checks=settings.check)

    def _over_budget(self, capacity: int, head_capacity: torch.Tensor | None, slack: int) -> bool:
        """True when some batch row stores more than the layer's budget: ``(capacity + slack) * Hkv``
        tokens over its KV heads (the per-head budgets' sum + ``slack * Hkv`` when an allocator gave them).
        With every head holding the same count this is "some head holds more than capacity + slack"."""
        if self.prompt is None:
            n, Hkv = self.storage.uniform_count(), self.storage.shape[1]
            if n is not None and head_capacity is None:
                return n > capacity + slack                      # the decode hot path: plain ints
            totals = self.storage.row_totals()
        else:
            counts = self.head_counts()
            Hkv, totals = counts.shape[1], counts.sum(-1).tolist()
        budget = capacity * Hkv if head_capacity is None else int(head_capacity.sum())
        return any(t > budget + slack * Hkv for t in totals)

    def select(self, rule, phase: str, capacity: int, view: StorageView, head_capacity=None):
        """Run ``rule`` on ``view``; check its selection; gather every observing state; return it."""
        state = self.states[phase]
        B, Hkv, _ = view.positions.shape
        ctx = self.context(phase, view, state, values=rule.needs_values,
                           head_capacity=None if head_capacity is None
                           else head_capacity.to(view.positions.device).expand(B, Hkv))
        op = getattr(self.spec.plan, phase)
        check = getattr(rule, "check_capacity", None)
        if check is not None and head_capacity is None:  # a capacity resolved from a ratio: known only now
            try:
                check(int(capacity))
            except ValueError as exc:
                ratio = "" if op.capacity_ratio is None else \
                    f" (capacity_ratio {op.capacity_ratio:g} of {self.tokens_seen} tokens)"
                raise RuntimeConfigError(f"layer {self.layer_idx} ({phase}): {exc}{ratio}") from None
        sel = checked_selection(rule.select(ctx, capacity), ctx, capacity,
                                where=f"layer {self.layer_idx} ({phase}): rule '{op.rule}'")
        for st in self.observing_states():
            st.gather(sel)
        return sel
