"""Runs an allocation group during prefill (see :mod:`polykv.contract.allocators` for the contract).

Group layers keep their prompt unstored until the allocator has decided. A cascading allocator is
asked after every group layer and the layers prefilled so far are re-selected at their new budgets
right away (their raw K/V shrink as the cascade proceeds); otherwise the allocator runs once, after
the group's last layer. Then every group layer's prompt is stored, and :attr:`GroupRun.report`
says what was allocated and what each head holds.
"""

from __future__ import annotations

from typing import Any

import torch

from polykv.contract.allocators import AllocationRequest
from polykv.runtime.plugin_results import checked_budgets
from polykv.errors import RuntimeConfigError
from polykv.contract.rules import SelectionContext  # noqa: F401 (the type allocators receive)


class GroupRun:
    """The state of one allocation group in one cache."""

    def __init__(self, group, allocator):
        self.group, self.allocator = group, allocator
        self.statistics: dict[int, Any] = {}
        self.report: dict[int, dict[str, Any]] = {}
        self.states = {layer: allocator.new_state() for layer in group.layers}
        """Group layer -> the allocator's state observing its prefill (None when the allocator keeps none)."""
        self.layers: dict[int, Any] = {}
        """Group layer -> its :class:`~polykv.runtime.layer_cache.LayerCache` (each joins when it is built)."""

    def join(self, layer):
        """``layer`` (a LayerCache of this group) is built: record it; return the state it must let observe
        its prefill (None: none)."""
        self.layers[layer.layer_idx] = layer
        return self.states[layer.layer_idx]

    def _context(self, layer) -> SelectionContext:
        state = self.states[layer.layer_idx]
        if state is None and self.allocator.reads_rule_state:
            state = layer.states["prefill"]
        return layer.context("prefill", layer.prompt, state, values=True)

    def layer_done(self, layer) -> None:
        """``layer`` finished its prefill: record its statistic, allocate when due, store when final."""
        name = self.group.allocator
        rows = int(layer.head_counts().shape[0])
        if rows > 1 and self.allocator.one_row:
            raise RuntimeConfigError(
                f"allocator '{name}' (allocation group {self.group.describe()}) decides one budget per layer from the "
                f"statistics of the whole prompt batch, so in a batch of {rows} rows each row's budgets would depend "
                f"on the other rows: run one prompt at a time (batch of 1), or use a plan without this group")
        self.statistics[layer.layer_idx] = self.allocator.layer_statistic(self._context(layer))
        done = tuple(sorted(self.statistics))
        final = len(done) == len(self.group.layers)
        if not (self.allocator.cascades or final):
            return
        T = layer.tokens_seen
        layers = self.layers
        caps = tuple(int(layers[i].spec.plan.prefill.resolve_capacity(T)) for i in self.group.layers)
        request = AllocationRequest(group_layers=tuple(self.group.layers), layers=done,
                                    statistics=tuple(self.statistics[i] for i in done), total=sum(caps),
                                    capacities=caps, context_tokens=T, num_kv_heads=layer.head_counts().shape[1],
                                    final=final)
        budgets = checked_budgets(self.allocator, self.allocator.allocate(request), request)
        for i, b in zip(done, budgets):
            target = layers[i]
            target.budget = b.clone() if b.dim() else int(b)
            cap = int(b.max())
            target.select_prompt(cap, b.clone() if b.dim() else None)
        if final:
            for i in self.group.layers:
                target = layers[i]
                target.store_prompt()
                budget = target.budget
                self.report[i] = {"budget": budget.tolist() if isinstance(budget, torch.Tensor) else budget,
                                  "stored": target.head_counts().tolist()}
