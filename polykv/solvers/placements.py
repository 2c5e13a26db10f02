"""Count-matched random placements: PolyKV's control for a guided route.

A route assigns one rule (or method) to every layer. Its control draws other arrangements of the same
rules over the layers, each rule on as many layers as in the route, so that a guided route is compared
with placements that differ only in *where* each rule runs. The solver ``random-placement`` and the
study summaries (:mod:`polykv.studies.stats`) both draw them here.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

ENUMERATE_UP_TO = 20_000
"""Routes with at most this many distinct placements draw from the full list (exact, never stalls);
larger ones sample permutations and reject repeats."""


def distinct_placements(route: Sequence[str]) -> int:
    """Number of distinct arrangements of ``route``'s rules over its layers (a multinomial)."""
    n = math.factorial(len(route))
    for c in Counter(route).values():
        n //= math.factorial(c)
    return n


def random_placements(route: Sequence[str], count: int, seed: int, *,
                      exclude: Sequence[Sequence[str]] = ()) -> list[tuple[str, ...]]:
    """``count`` unique seeded rearrangements of ``route`` (each rule on as many layers), none in ``exclude``.

    Raises ValueError when fewer than ``count`` placements are left after the exclusions.
    """
    pool_items = sorted(route)
    seen = {tuple(e) for e in exclude}
    excluded = sum(1 for e in seen if sorted(e) == pool_items)
    total = distinct_placements(route)
    if count > total - excluded:
        raise ValueError(f"only {total - excluded} placements are left ({total} distinct, {excluded} excluded); "
                         f"asked for {count}")
    rng = np.random.default_rng(seed)
    if total <= ENUMERATE_UP_TO:
        pool = [pl for pl in _multiset_permutations(pool_items) if pl not in seen]
        return [pool[int(i)] for i in rng.permutation(len(pool))[:count]]
    out: list[tuple[str, ...]] = []
    while len(out) < count:
        perm = tuple(route[i] for i in rng.permutation(len(route)))
        if perm not in seen:
            seen.add(perm)
            out.append(perm)
    return out


def _multiset_permutations(items: list[str]):
    """Distinct permutations of ``items`` in lexicographic order (``items`` sorted)."""
    if not items:
        yield ()
        return
    for i, x in enumerate(items):
        if i and items[i - 1] == x:
            continue
        for rest in _multiset_permutations(items[:i] + items[i + 1:]):
            yield (x,) + rest
