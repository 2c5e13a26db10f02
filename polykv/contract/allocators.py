"""Allocators: budgets decided at run time, from statistics gathered during prefill.

A plan can put layers in an *allocation group* (:class:`polykv.plan.AllocationGroup`): the group's
total budget is the sum of its layers' prefill capacities (as the plan gives them), and a registered
:class:`Allocator` redistributes that total across the group's layers (and optionally their KV
heads) once their prefill statistics are known. Static allocations (a pyramid) stay with solvers.

Flow in the runtime, for one group:

1. each group layer's prefill runs attention on the raw prompt as usual; its allocator state
   (:meth:`Allocator.new_state`) observes every forward of that layer;
2. after the layer's last prefill forward the runtime calls :meth:`Allocator.layer_statistic` with
   the layer's :class:`~polykv.contract.rules.SelectionContext` and keeps the result; the layer's raw
   K/V wait, unselected;
3. a cascading allocator (``cascades = True``) is asked to :meth:`Allocator.allocate` after every
   group layer, over the layers prefilled so far, and each of those layers is re-selected at its
   new budget right away (its rule state was gathered alongside, so it is never recomputed);
   otherwise :meth:`Allocator.allocate` runs once, after the group's last layer;
4. the final budgets replace the capacities of the group layers' ops (prefill, and decode when
   the decode op evicts), and the stores are filled. ``cache.allocations()`` reports them.

The memory model cannot know the budgets ahead of time; it reports :meth:`Allocator.bound`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import attrs
import torch

from polykv.contract.params import DeclaredParams


@attrs.define(frozen=True, kw_only=True)
class AllocationRequest:
    """What an allocator is asked to distribute, and what it knows so far."""

    group_layers: tuple[int, ...]
    """Every layer of the group, ascending."""
    layers: tuple[int, ...]
    """The group layers prefilled so far (all of them unless cascading), ascending."""
    statistics: tuple[Any, ...]
    """:meth:`Allocator.layer_statistic` of each layer in ``layers``."""
    total: int
    """Tokens per KV head to distribute over ``group_layers``: the sum of their planned capacities."""
    capacities: tuple[int, ...]
    """The planned (static) capacity of each layer in ``group_layers``."""
    context_tokens: int
    """Prompt length S (no layer can keep more)."""
    num_kv_heads: int
    final: bool
    """True when every group layer has been prefilled (the last call)."""


class Allocator(DeclaredParams):
    """Base class of allocators. Subclasses set the class attributes and implement the two methods.

    Parameters are declared in ``param_specs`` (:class:`polykv.contract.params.ParamSpec` with a default;
    see :class:`polykv.contract.params.DeclaredParams`); unknown names and values outside their specs are
    an error, raised when a plan naming the allocator is validated.
    """

    plugin_kind = "allocator"
    name: ClassVar[str]
    paper: ClassVar[str] = ""
    cascades: ClassVar[bool] = False
    """True: re-allocate after every group layer (CAKE); False: once, after the last (D2O)."""
    one_row: ClassVar[bool] = False
    """True when the budgets come from statistics of the prompt: they are one per layer (or head) for every
    batch row, so rows would change each other's budgets, and the runtime refuses a batch of more than
    one row (D2O, CAKE). False when they depend only on the group's shape and total (a pyramid)."""

    reads_rule_state: ClassVar[bool] = False
    """True: :meth:`layer_statistic` reads the layer's prefill rule's own state as ``ctx.state`` (the rule already
    holds what the allocator ranks, e.g. KVzip's reconstruction scores) instead of a state of its own."""

    def check_op(self, op) -> tuple[str, str] | None:
        """Why this allocator cannot budget a member layer's op (a plan ``OpSpec`` of either phase), as
        ``(field under the op, reason)``, or None when it can. Plan validation refuses the plan with it."""
        return None

    def new_state(self):
        """A :class:`~polykv.contract.state.RuleState` observing one group layer's prefill, or None."""
        return None

    def layer_statistic(self, ctx) -> Any:
        """The statistic of one layer (any object), from its end-of-prefill SelectionContext.

        ``ctx.state`` is this allocator's state for the layer (``new_state``), or the layer's prefill rule's
        state when the allocator ``reads_rule_state``.
        """
        raise NotImplementedError

    def allocate(self, request: AllocationRequest) -> torch.Tensor:
        """Budgets of ``request.layers``: int64 [n] tokens per KV head, or [n, Hkv] per head.

        The runtime clips every budget to [1, context_tokens]. Per-head budgets reach the rule as
        ``ctx.head_capacity``; ``capacity`` is then their maximum.
        """
        raise NotImplementedError

    def bound(self, capacities: Sequence[int], context_tokens: int) -> list[int]:
        """The most tokens per KV head each group layer may hold after allocation (memory model).

        Default: the whole group total could land on one layer, capped by the context.
        """
        total = sum(capacities)
        return [min(total, context_tokens) for _ in capacities]

    def group_bound(self, capacities: Sequence[int], context_tokens: int) -> int:
        """The most tokens per KV head the whole group may hold (default: the total, capped by the context)."""
        return min(sum(capacities), context_tokens * len(capacities))
