"""Capacity schedules shared by a solver and an allocator: PyramidKV's staircase.

The ``pyramid`` solver (:mod:`polykv.solvers.pyramid`) writes this schedule into a plan; the
PyramidKV allocator plugin computes the same schedule at run time from the layers' budgets. The
formula and its budget trim are described in :mod:`polykv.solvers.pyramid`.
"""

from __future__ import annotations

from polykv.errors import SolverError


def pyramid_capacities(num_layers: int, context_tokens: int, average: int, *, window: int = 8,
                       beta: int = 20, fix: str = "raise the group layers' capacities or lower the window") -> list[int] | None:
    """Tokens each layer keeps, or None for no compression (``context_tokens < average``).

    A window at or above the average is a :class:`SolverError` whose ``param`` is ``"window"``, ending in
    ``fix`` (what the caller's user changes: a solver's ``--param window``, a plan group's field).
    """
    L, T, M, w = num_layers, context_tokens, average, window
    if T < M:
        return None
    if M <= w:
        exc = SolverError(f"pyramid: the average budget {M} tokens per layer must exceed the window {w}; {fix}")
        exc.param = "window"
        raise exc
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
    """Remove tokens from the largest layers (lowest index first) until ``sum(caps) <= total``.

    The same result as taking one token at a time from the largest layer (lowest index among ties), in
    O(L log C) rather than O(excess x L) (the excess grows as L^2): every layer above a level ``t`` is cut
    to ``t``, then the few tokens still over come from the lowest-index layers at ``t``.
    """
    caps, excess = list(caps), sum(caps) - total
    if excess <= 0 or not caps:
        return caps, 0

    def over(level: int) -> int:
        return sum(c - level for c in caps if c > level)

    lo, hi = min(caps) - excess // len(caps) - 1, max(caps)  # over(lo) > excess >= over(hi) = 0
    while hi - lo > 1:  # the lowest level whose cut removes no more than the excess
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) <= excess else (mid, hi)
    rest = excess - over(hi)
    for i, c in enumerate(caps):
        if c >= hi:
            caps[i] = hi - 1 if rest > 0 else hi
            rest -= 1
    return caps, excess
