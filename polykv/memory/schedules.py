"""Capacity schedules shared by a solver and an allocator: PyramidKV's staircase.

The ``pyramid`` solver (:mod:`polykv.solvers.pyramid`) writes this schedule into a plan; the
PyramidKV allocator plugin computes the same schedule at run time from the layers' budgets. The
formula and its budget trim are described in :mod:`polykv.solvers.pyramid`.
"""

from __future__ import annotations

from polykv.errors import SolverError


def pyramid_capacities(num_layers: int, context_tokens: int, average: int, *, window: int = 8,
                       beta: int = 20) -> list[int] | None:
    """Tokens each layer keeps, or None for no compression (``context_tokens < average``)."""
    L, T, M, w = num_layers, context_tokens, average, window
    if T < M:
        return None
    if M <= w:
        raise SolverError(f"pyramid: the average budget {M} tokens must exceed the window {w}; raise the budget "
                          "or lower --param window")
    if T < 2 * (M - w) or L == 1:
        return [M] * L
    lo = (M - w) // beta
    hi = 2 * (M - w) - lo
    if hi >= T - w:
        hi = T - w
        lo = 2 * (M - w) - hi
    step = (hi - lo) // (L - 1)
    caps = [(hi - l * step) + w for l in range(L)]
    if caps[-1] < 1:
        raise SolverError(f"pyramid: layer {L - 1} would keep {caps[-1]} tokens; raise the budget or the window")
    return caps


def trim_to(caps: list[int], total: int) -> tuple[list[int], int]:
    """Remove tokens from the largest layers (lowest index first) until ``sum(caps) <= total``."""
    caps, excess = list(caps), sum(caps) - total
    removed = max(excess, 0)
    while excess > 0:
        i = max(range(len(caps)), key=lambda j: (caps[j], -j))
        caps[i] -= 1
        excess -= 1
    return caps, removed
