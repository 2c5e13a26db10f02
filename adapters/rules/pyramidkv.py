"""PyramidKV: a pyramid of layer budgets (more in lower layers) with observation-window selection.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv:2406.02069. Reference code: https://github.com/Zefan-Cai/KVCache-Factory
(``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster``; ``run_longbench.py`` sets window 8,
kernel 7, max pooling for every PyramidKV run).

The method has two halves. The *selection* of one layer is SnapKV's observation-window vote
(``PyramidKVRule``, this file). The *allocation* is the pyramid: with M the average budget per
layer (window included) and beta = 20,

    min = floor((M - w) / beta);  max = 2 (M - w) - min
    if max >= T - w:  max = T - w;  min = 2 (M - w) - max
    step = floor((max - min) / (L - 1));  layer l keeps (max - l * step) + w

with no compression when T < M and a uniform M when T < 2 (M - w) (:func:`pyramid_budgets`).
"""

from __future__ import annotations

import torch

from polykv.adapters.rules.snapkv import SnapKVRule
from polykv.contract import Allocator, allocators, param, schedules


class PyramidKVRule(SnapKVRule):
    """SnapKV's window vote with PyramidKV's reference settings (window 8, kernel 7, max pooling).

    Keep the last ``window`` tokens plus the top ``capacity - window`` prefix tokens by pooled
    window votes, per KV head (see the ``snapkv`` rule for the exact vote). The per-layer capacity
    comes from the pyramid allocation (the ``pyramidkv`` allocator, or the ``pyramid`` solver for a
    static plan). Prefill only, as in the reference.

    Parameters
    ----------
    window : int, default 8
        Observation window (reference run setting ``window_sizes = 8``; the class default is 64).
    kernel_size : int, default 7
        Pooling kernel (reference run setting; the class default is 5).
    pooling : {"max", "avg"}, default "max"
        Vote pooling (reference run setting ``maxpool``; the class default is ``avgpool``).
    """

    name = "pyramidkv"
    window = 8
    kernel_size = 7
    pooling = "max"
    paper = ("Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information "
             "Funneling, arXiv:2406.02069")


def pyramid_budgets(num_layers: int, context_tokens: int, total_tokens: int, *, window: int = 8,
                    beta: int = 20) -> list[int]:
    """Tokens each of ``num_layers`` layers keeps so that they sum to at most ``total_tokens``.

    The pyramid around the average ``M = total_tokens // num_layers`` (window included), capped at
    the context; the floor in ``step`` can overshoot by up to L (L - 1) / 2 tokens, which are taken
    one at a time from the largest layers (lowest index first) so the total is never exceeded.
    """
    M = total_tokens // num_layers
    caps = schedules.pyramid_capacities(num_layers, context_tokens, M, window=window, beta=beta)
    if caps is None:
        return [min(context_tokens, M)] * num_layers
    caps, _ = schedules.trim_to([min(c, context_tokens) for c in caps], total_tokens)
    return caps


class PyramidKVAllocator(Allocator):
    """The pyramid (:func:`pyramid_budgets`) over an allocation group's layers, lowest layer first.

    Needs no statistics: the budgets depend only on the group size, the prompt length and the
    group's total, so the memory model's bound is exact.

    Parameters
    ----------
    window : int, default 8
        The window included in every layer's budget (must equal the rule's).
    beta : int, default 20
        Ratio of the largest to the smallest non-window budget's spread (reference ``beta = 20``).
    """

    name = "pyramidkv"
    window: int = param(8, low=0, high=1 << 20, description="window included in every budget")
    beta: int = param(20, low=1, high=1 << 20, description="largest to smallest budget spread")
    paper = PyramidKVRule.paper

    def layer_statistic(self, ctx) -> None:
        return None

    def _budgets(self, layers: int, context_tokens: int, total: int) -> list[int]:
        return pyramid_budgets(layers, context_tokens, total, window=int(self.window),
                               beta=int(self.beta))

    def allocate(self, request: allocators.AllocationRequest) -> torch.Tensor:
        caps = self._budgets(len(request.group_layers), request.context_tokens, request.total)
        where = {layer: i for i, layer in enumerate(request.group_layers)}
        return torch.tensor([caps[where[layer]] for layer in request.layers], dtype=torch.int64)

    def bound(self, capacities, context_tokens: int) -> list[int]:
        return self._budgets(len(capacities), context_tokens, sum(capacities))
