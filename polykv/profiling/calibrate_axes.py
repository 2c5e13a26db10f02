"""The two axes a calibration measures beside the rule table: key/value ranks and shared layer pairs.

With ``ranks`` (``polykv calibrate --ranks``) every full-rank config gets a low-rank twin for each (k_rank,
v_rank) pair the quantizer can code (:func:`rank_configs`), whose ``l2`` is additive: the config's own error plus
the rank pair's measured error at 16 bits (:func:`with_ranks`). With ``pairs`` (``--pairs``) every adjacent pair
of full-attention layers of one attention type is measured shared (MiniCache, :func:`measure_pairs`).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from polykv.errors import ProfileError
from polykv.profiling.profile import CandidateConfig, Profile, StatTable
from polykv.profiling.capture import stack_layer


def rank_pairs(ranks: Sequence[int | None]) -> list[tuple[int | None, int | None]]:
    """Every (k_rank, v_rank) of ``ranks`` x ``ranks`` except full width for both, in order."""
    ranks = list(dict.fromkeys(ranks))
    return [(k, v) for k in ranks for v in ranks if (k, v) != (None, None)]


def rank_label(k_rank: int | None, v_rank: int | None) -> str:
    """``K<k>V<v>`` with ``d`` for full width: a column of the ``rank_l2`` statistic."""
    return "K{}V{}".format(*("d" if r is None else r for r in (k_rank, v_rank)))


def rank_configs(configs: Sequence[CandidateConfig], pairs: Sequence[tuple[int | None, int | None]],
                 quantizer) -> tuple[list[tuple[int, int]], int]:
    """``[(config column, rank pair index)]`` of the low-rank configs: every full-rank config at every rank pair
    whose code widths ``quantizer`` accepts at the config's bits; and how many combinations it refused."""
    out, refused = [], 0
    for c, cfg in enumerate(configs):
        for r, (kr, vr) in enumerate(pairs):
            try:
                for stream, bits, rank in (("key", cfg.k_bits, kr), ("value", cfg.v_bits, vr)):
                    if rank is not None and bits != 16:
                        quantizer.check_width(stream, bits, rank)
            except ValueError:
                refused += 1
                continue
            out.append((c, r))
    return out, refused


def with_ranks(profile: Profile, rank_l2: np.ndarray, pairs: Sequence[tuple[int | None, int | None]],
               quantizer) -> Profile:
    """``profile`` with the low-rank configs added: the measured ``rank_l2`` [L, len(pairs)] as a statistic, and for
    every full-rank config c and rank pair r the quantizer accepts, a config whose ``l2`` is the additive model's
    ``l2[l, c] + rank_l2[l, r]`` (the error of (rule, keep, bits) plus the error of the ranks at 16 bits)."""
    base = list(profile.configs)
    combos, refused = rank_configs(base, pairs, quantizer)
    l2 = profile.metrics["l2"]
    cols = [l2[:, c] + rank_l2[:, r] for c, r in combos]
    configs = base + [attrs.evolve(base[c], k_rank=pairs[r][0], v_rank=pairs[r][1]) for c, r in combos]
    stats = dict(profile.stats)
    stats["rank_l2"] = StatTable(columns=tuple(rank_label(*p) for p in pairs), values=rank_l2, higher_is_better=False,
                                 description="relative L2 error of the layer's follow-up attention output with key/value "
                                 "codes of these ranks (runtime code space, 16 bits, every token kept), mean over "
                                 "calibration sequences")
    note = (f"low-rank configs: {len(combos)} = {len(base)} configs x {len(pairs)} rank pairs"
            + (f" less {refused} the quantizer cannot code" if refused else "")
            + "; their l2 is additive: l2(rule, keep, K bits, V bits) + rank_l2(k_rank, v_rank)")
    prov = attrs.evolve(profile.provenance, note=f"{profile.provenance.note}; {note}")
    return attrs.evolve(profile, configs=configs, metrics={"l2": np.column_stack([l2] + cols)}, stats=stats,
                        provenance=prov)


def measure_pairs(geometry, captures, prefix: int):
    """The pair table of every adjacent pair of full-attention layers of one attention type
    (:func:`~polykv.profiling.share_error.pair_errors` on the calibration sequences as one batch)."""
    from polykv.profiling.profile import PairTable
    from polykv.profiling.share_error import pair_errors

    L = geometry.num_layers
    types = getattr(geometry, "layer_types", None) or ["full_attention"] * L
    windowed = getattr(geometry, "is_windowed", lambda layer: False)
    ups = [u for u in range(1, L) if types[u] == types[u - 1] and not windowed(u) and not windowed(u - 1)]
    if not ups:
        raise ProfileError("--pairs: this model has no two adjacent full-attention layers of one attention type to "
                           "share; leave --pairs out")
    layers = [stack_layer(captures, layer) for layer in range(L)]
    errs = pair_errors(layers, prefix, pairs=[(u - 1, u) for u in ups])
    return PairTable(uppers=ups, values=[[e.lower_error, e.upper_error] for e in errs],
                     description="relative L2 error of the lower and upper layer's follow-up attention output with "
                     "the pair's prefix merged (MiniCache, runtime storage, default merge parameters), both layers "
                     "keeping every token at 16 bits; a pair's loss is the sum of the two")
