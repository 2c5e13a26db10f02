"""The two axes a calibration measures beside the rule table: key/value ranks and shared layer pairs.

With ``ranks`` (``polykv calibrate --ranks``) every full-rank config gets a low-rank twin for each (k_rank,
v_rank) pair the quantizer can code (:func:`rank_configs`), whose loss in every metric table is additive: the
config's own loss plus the rank pair's measured loss at 16 bits (:func:`with_ranks`; ``rank_l2`` for ``l2``, and,
with held-out sequences, ``rank_<metric>`` measured end to end on each objective,
:mod:`polykv.profiling.axes_endtoend`). With ``pairs`` (``--pairs``) every adjacent pair of full-attention layers
of one attention type is measured shared (MiniCache, :func:`measure_pairs`; end to end: the statistic
``pair_<metric>``, :func:`pair_losses`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs
import numpy as np

from polykv.errors import ProfileError
from polykv.profiling.capture import stack_layer
from polykv.profiling.profile import CandidateConfig, PairTable, Profile, StatTable
from polykv.profiling.profile_checks import MIX_METRIC, mix_tables
from polykv.profiling.share_error import pair_errors


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


RANK_L2_DESCRIPTION = ("relative L2 error of the layer's follow-up attention output with key/value codes of these "
                       "ranks (runtime code space, 16 bits, every token kept), mean over calibration sequences")


def with_ranks(profile: Profile, rank_tables: Mapping[str, np.ndarray], pairs: Sequence[tuple[int | None, int | None]],
               quantizer, descriptions: Mapping[str, str] | None = None) -> Profile:
    """``profile`` with the low-rank configs added. ``rank_tables`` holds, for every metric table of the profile
    (the objective mix aside: it is mixed again from its parts), the measured loss of each rank pair on one layer
    [L, len(pairs)]; each becomes the statistic ``rank_<metric>``, and for every full-rank config c and rank pair r
    the quantizer accepts, a config whose loss in that metric is the additive model's ``m[l, c] + rank_m[l, r]``
    (the loss of (rule, keep, bits) plus the loss of the ranks at 16 bits)."""
    missing = sorted(set(profile.metrics) - {MIX_METRIC} - set(rank_tables))
    if missing:
        raise ProfileError(f"the rank pairs were not measured in metric(s) {missing}; measure them or leave --ranks out")
    base = list(profile.configs)
    combos, refused = rank_configs(base, pairs, quantizer)
    configs = base + [attrs.evolve(base[c], k_rank=pairs[r][0], v_rank=pairs[r][1]) for c, r in combos]
    stats, metrics = dict(profile.stats), {}
    for name, table in profile.metrics.items():
        if name == MIX_METRIC:
            continue
        rank = np.asarray(rank_tables[name], np.float64)
        metrics[name] = np.column_stack([table] + [table[:, c] + rank[:, r] for c, r in combos])
        stats[f"rank_{name}"] = StatTable(columns=tuple(rank_label(*p) for p in pairs), values=rank,
                                          higher_is_better=False, description=(descriptions or {}).get(
                                              name, RANK_L2_DESCRIPTION if name == "l2" else
                                              f"metric {name} of the one-layer plan with key/value codes of these "
                                              "ranks (16 bits, every token kept), measured end to end"))
    if profile.objective_weights:
        metrics[MIX_METRIC] = mix_tables(metrics, profile.objective_weights)
    note = (f"low-rank configs: {len(combos)} = {len(base)} configs x {len(pairs)} rank pairs"
            + (f" less {refused} the quantizer cannot code" if refused else "")
            + "; their loss is additive in every metric: m(rule, keep, K bits, V bits) + rank_m(k_rank, v_rank)")
    prov = attrs.evolve(profile.provenance, note=f"{profile.provenance.note}; {note}")
    return attrs.evolve(profile, configs=configs, metrics=metrics, stats=stats, provenance=prov)


def pair_uppers(geometry) -> list[int]:
    """Upper layer of every adjacent pair of full-attention layers of one attention type (refused when none)."""
    L = geometry.num_layers
    types = getattr(geometry, "layer_types", None) or ["full_attention"] * L
    windowed = getattr(geometry, "is_windowed", lambda layer: False)
    ups = [u for u in range(1, L) if types[u] == types[u - 1] and not windowed(u) and not windowed(u - 1)]
    if not ups:
        raise ProfileError("--pairs: this model has no two adjacent full-attention layers of one attention type to "
                           "share; leave --pairs out")
    return ups


def pair_stats(profile: Profile, tables: Mapping[str, np.ndarray]) -> Profile:
    """``profile`` with the end-to-end loss of sharing each pair in every metric of ``tables`` ([L] per metric, the
    value at the pair's upper layer; 0 at layers that are no pair's upper) as the statistic ``pair_<metric>``, and
    the objective mix of them as ``pair_kl_mix``."""
    stats = dict(profile.stats)
    tables = {name: np.asarray(v, np.float64).reshape(-1, 1) for name, v in tables.items()}
    if profile.objective_weights:
        tables[MIX_METRIC] = mix_tables(tables, profile.objective_weights)
    for name, values in tables.items():
        stats[f"pair_{name}"] = StatTable(columns=("pair",), values=values, higher_is_better=False,
                                          description=f"metric {name} of the plan sharing the pair (l - 1, l) (16 bits, "
                                          "every token kept), at row l of each measured pair (0 elsewhere), measured "
                                          "end to end")
    return attrs.evolve(profile, stats=stats)


def pair_losses(profile: Profile, metric: str) -> np.ndarray | None:
    """[len(pairs.uppers)] each measured pair's loss in ``metric``: the pair table's for ``l2``, else the statistic
    ``pair_<metric>``; None when the profile did not price its pairs in that metric."""
    if profile.pairs is None:
        return None
    if metric == "l2":
        return profile.pairs.loss
    stat = profile.stats.get(f"pair_{metric}")
    return None if stat is None else stat.values[list(profile.pairs.uppers), 0]


def measure_pairs(geometry, captures, prefix: int):
    """The pair table of every adjacent pair of full-attention layers of one attention type
    (:func:`~polykv.profiling.share_error.pair_errors` on the calibration sequences as one batch)."""
    L = geometry.num_layers
    ups = pair_uppers(geometry)
    layers = [stack_layer(captures, layer) for layer in range(L)]
    errs = pair_errors(layers, prefix, pairs=[(u - 1, u) for u in ups])
    return PairTable(uppers=ups, values=[[e.lower_error, e.upper_error] for e in errs],
                     description="relative L2 error of the lower and upper layer's follow-up attention output with "
                     "the pair's prefix merged (MiniCache, runtime storage, default merge parameters), both layers "
                     "keeping every token at 16 bits; a pair's loss is the sum of the two")
