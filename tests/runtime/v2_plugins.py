"""Small rules and allocators that exercise each family of the v2 contract in runtime tests.

They are deliberately simple and deterministic: a head-wise rule (ragged counts), a merging rule
(evicted values folded into kept ones, optionally keys too), a stateful rule with its own state, and
two allocators (one-shot and cascading).
"""

from __future__ import annotations

import torch

import polykv
from polykv.contract.allocators import AllocationRequest, Allocator
from polykv.contract.rules import ScoredRule, SelectionContext
from polykv.contract.state import RuleState
from polykv.contract.selection import Merge, Selection, ragged_top_k, top_k_sorted


class HeadwiseNorm(ScoredRule):
    """Low key norm first; KV head h keeps a share of the layer budget growing with h (ragged)."""

    name = "test-headwise"
    phases = frozenset({"prefill", "decode"})

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        return -ctx.keys.float().norm(dim=-1)

    def select(self, ctx: SelectionContext, capacity: int):
        B, Hkv, T = ctx.positions.shape
        weights = torch.arange(1, Hkv + 1, dtype=torch.float64)
        share = torch.floor(weights / weights.sum() * capacity * Hkv).long()
        counts = torch.minimum(share.clamp_min(1).expand(B, Hkv), ctx.head_lengths())
        scores = self.score(ctx)
        if ctx.valid is not None:
            scores = scores.masked_fill(~ctx.valid, float("-inf"))
        return ragged_top_k(scores, counts)


class MergeIntoNext(ScoredRule):
    """Keep the newest ``capacity`` tokens; every evicted token adds ``weight`` x itself to the oldest
    kept token (values, and keys when ``keys`` is true)."""

    name = "test-merge"
    phases = frozenset({"prefill", "decode"})
    defaults = {"weight": 0.5, "keys": False}

    def __init__(self, **params):
        super().__init__(**params)
        self.targets_log: list[torch.Tensor] = []

    def score(self, ctx):
        return ctx.positions.float()

    def select(self, ctx, capacity):
        index = top_k_sorted(self.score(ctx), capacity)                        # (B, Hkv, cap) newest
        B, Hkv, T = ctx.positions.shape
        kept = torch.zeros(B, Hkv, T, dtype=torch.bool).scatter_(-1, index, True)
        E = T - capacity
        evicted = torch.sort(torch.where(kept, T, torch.arange(T)), dim=-1).values[..., :E]   # (B, Hkv, E)
        targets = index[..., :1].unsqueeze(-1).expand(B, Hkv, E, 1)
        weights = torch.full((B, Hkv, E, 1), float(self.params["weight"]))
        self.targets_log.append(ctx.positions.gather(-1, index[..., :1]).clone())
        streams = {"key", "value"} if self.params["keys"] else {"value"}
        return Selection(index=index, merge=Merge(evicted=evicted, targets=targets, weights=weights, streams=streams))


class SeenCount(RuleState):
    """How many forwards each stored token has been attended in (its own per-token tensor)."""

    share_key = None

    def __init__(self):
        self.reset()

    def reset(self):
        self.counts = None

    def observe(self, obs):
        q = obs.num_new
        ones = torch.ones(obs.positions.shape, dtype=torch.float32)
        self.counts = ones if self.counts is None else torch.nn.functional.pad(self.counts, (0, q)) + 1

    def gather(self, selection):
        self.counts = self.counts.gather(-1, selection.index)

    def nbytes(self):
        return 0 if self.counts is None else self.counts.numel() * 4

    def predict_bytes(self, *, batch, kv_heads, tokens, **_):
        return 4 * batch * kv_heads * tokens


class OldestSeen(ScoredRule):
    """Keep the tokens seen in the most forwards (a stateful rule owning a SeenCount)."""

    name = "test-seen"
    phases = frozenset({"prefill", "decode"})

    def new_state(self):
        return SeenCount()

    def score(self, ctx):
        return ctx.state.counts


class LayerIndexShare(Allocator):
    """Budgets proportional to ``1 + layer index`` (statistic: the layer index)."""

    name = "test-layer-share"
    defaults = {"cascade": False}

    def layer_statistic(self, ctx):
        return float(ctx.layer_idx + 1)

    def allocate(self, request: AllocationRequest):
        stats = torch.tensor(request.statistics, dtype=torch.float64)
        return torch.floor(stats / stats.sum() * request.total).long()


class CascadingShare(LayerIndexShare):
    name = "test-cascade"
    cascades = True

    def __init__(self, **params):
        super().__init__(**params)
        self.calls: list[tuple] = []

    def allocate(self, request):
        self.calls.append(request.layers)
        return super().allocate(request)


class HeadShare(Allocator):
    """Per-head budgets: head h of every layer gets a share growing with h."""

    name = "test-head-share"

    def layer_statistic(self, ctx):
        return ctx.num_kv_heads

    def allocate(self, request):
        Hkv = request.num_kv_heads
        per_layer = request.total // len(request.group_layers)
        w = torch.arange(1, Hkv + 1, dtype=torch.float64)
        heads = torch.floor(w / w.sum() * per_layer * Hkv).long()
        return heads.expand(len(request.layers), Hkv).clone()


class V2Plugins:
    @polykv.hookimpl
    def register_operators(self, register):
        for rule in (HeadwiseNorm, MergeIntoNext, OldestSeen):
            register(rule)

    @polykv.hookimpl
    def register_allocators(self, register):
        for alloc in (LayerIndexShare, CascadingShare, HeadShare):
            register(alloc)


def registry_with_plugins():
    from polykv.registry import Registry

    registry = Registry(load_entry_points=False)
    registry.register_plugin(V2Plugins(), name="v2-test-plugins")
    return registry
