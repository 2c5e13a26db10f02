"""The moves ``refine`` tries (:mod:`polykv.solvers.refine`): a layer to a neighbour config of the menu, or a swap of
two layers within the budget, ranked by the profile's predicted gain per bit."""

from __future__ import annotations

import json

import numpy as np


def menu_neighbours(configs) -> list[list[int]]:
    """Per config, the configs one step away (module docstring), in column order."""
    def family(c):
        return (c.rule, c.phase, json.dumps(c.params, sort_keys=True))

    keeps: dict[tuple, list[float]] = {}
    bits: dict[tuple, dict[str, list[int]]] = {}
    at: dict[tuple, int] = {}
    for i, c in enumerate(configs):
        at[(family(c), c.keep, c.k_bits, c.v_bits)] = i
    full = {(c.k_bits, c.v_bits): i for i, c in enumerate(configs) if c.keeps_everything}
    for c in configs:
        if c.keeps_everything:
            continue
        keeps.setdefault((family(c), c.k_bits, c.v_bits), []).append(c.keep)
        b = bits.setdefault((family(c), c.keep), {"k": [], "v": []})
        b["k"].append(c.k_bits)
        b["v"].append(c.v_bits)
    by_widths: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        if not c.keeps_everything:
            by_widths.setdefault((c.keep, c.k_bits, c.v_bits), []).append(i)

    def adjacent(values, value):
        vs = sorted(set(values))
        j = vs.index(value)
        return [vs[k] for k in (j - 1, j + 1) if 0 <= k < len(vs)]

    out = []
    for i, c in enumerate(configs):
        near = set()
        if c.keeps_everything:
            for (fam, k, v), ks in keeps.items():  # every rule's largest keep at these widths
                if (k, v) == (c.k_bits, c.v_bits):
                    near.add(at[(fam, max(ks), k, v)])
            for k in adjacent([kv[0] for kv in full if kv[1] == c.v_bits], c.k_bits):
                near.add(full[(k, c.v_bits)])
            for v in adjacent([kv[1] for kv in full if kv[0] == c.k_bits], c.v_bits):
                near.add(full[(c.k_bits, v)])
        else:
            fam = family(c)
            ks = keeps[(fam, c.k_bits, c.v_bits)]
            for keep in adjacent(ks, c.keep):
                near.add(at[(fam, keep, c.k_bits, c.v_bits)])
            if c.keep == max(ks) and (c.k_bits, c.v_bits) in full:
                near.add(full[(c.k_bits, c.v_bits)])
            for k in adjacent(bits[(fam, c.keep)]["k"], c.k_bits):
                if (fam, c.keep, k, c.v_bits) in at:
                    near.add(at[(fam, c.keep, k, c.v_bits)])
            for v in adjacent(bits[(fam, c.keep)]["v"], c.v_bits):
                if (fam, c.keep, c.k_bits, v) in at:
                    near.add(at[(fam, c.keep, c.k_bits, v)])
            near.update(by_widths[(c.keep, c.k_bits, c.v_bits)])
        near.discard(i)
        out.append(sorted(near))
    return out


def ranked_moves(table: np.ndarray, bits: np.ndarray, choice: list[int], cap: int,
                 neighbours: list[list[int]], allowed: set[int]) -> list[tuple]:
    """Every move of ``choice`` (a column per layer) that keeps the plan within ``cap`` bits, best predicted
    gain per bit first: ``((layer, new column), ...)`` tuples with one or two changes.

    A single move changes one layer; a swap raises one layer's bits and lowers another's, for an upgrade
    that does not fit alone (one that does is a single move). The order is
    -Δloss / max(1, bits added to the upgraded layer), ties by smaller Δloss, then by layer and column.
    """
    used = int(sum(int(bits[c]) for c in choice))
    single = []  # (layer, new, dloss, dbits)
    for layer, c in enumerate(choice):
        for n in neighbours[c]:
            if n in allowed:
                single.append((layer, n, float(table[layer, n] - table[layer, c]), int(bits[n]) - int(bits[c])))
    moves = []  # (key, dloss, changes)
    for layer, n, dl, db in single:
        if used + db <= cap:
            moves.append((-dl / max(1, db), dl, ((layer, n),)))
    ups = [m for m in single if m[3] > 0]
    downs = [m for m in single if m[3] < 0]
    if ups and downs:
        udl = np.array([m[2] for m in ups])
        udb = np.array([m[3] for m in ups], dtype=np.int64)
        ddl = np.array([m[2] for m in downs])
        ddb = np.array([m[3] for m in downs], dtype=np.int64)
        fits = (used + udb[:, None] + ddb[None, :] <= cap) & (used + udb[:, None] > cap)  # only as a pair
        ulay = np.array([m[0] for m in ups])
        dlay = np.array([m[0] for m in downs])
        fits &= ulay[:, None] != dlay[None, :]
        for a, b in zip(*np.nonzero(fits)):
            dl = float(udl[a] + ddl[b])
            changes = tuple(sorted(((ups[a][0], ups[a][1]), (downs[b][0], downs[b][1]))))
            moves.append((-dl / max(1, int(udb[a])), dl, changes))
    moves.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [m[2] for m in moves]


def apply_move(choice: list[int], move) -> list[int]:
    """``choice`` (a column per layer) with the move's ``(layer, column)`` changes made."""
    out = list(choice)
    for layer, col in move:
        out[layer] = col
    return out
