"""One profile from two calibrations of the same model on the same sequences: new rules added to a profile.

A rule written after a profile was calibrated (a plugin, or a rule added to polykv) need not cost a whole new
calibration: calibrate only it with the same settings (``polykv calibrate ... --rules NEW --extend BASE``) and
the two tables become one. That is sound only when both measured the same thing, so :func:`merge_profiles`
refuses, naming the field, unless the model (fingerprint and geometry), the calibration corpus (its texts'
digest), the seed, the compressed prefix, the compute dtype, the quantizer and its parameters and the set of
metric tables are the same. A config already in the base (the keep-everything configs every calibration measures)
is kept once when both measured the same values, and refused otherwise.

Per-(layer, rule) statistics (``cosine`` and the like) gain the new rules' columns; per-layer statistics measured
in both (``entropy``) must agree, since they come from the same sequences; a statistic that summarises each
calibration's own configs (``l2_kl_correlation``) holds for neither merged set and is dropped, as the note says. The base keeps its pair table and
routing metric; the merged profile says in its provenance note which rules were added, and when, and lists the
base's fingerprint in ``provenance.extends``: a plan solved from the base keeps its predicted loss under the merged
profile (its configs' values are the same), so a report can rank it beside plans solved from the merged one.
"""

from __future__ import annotations

import attrs
import numpy as np

from polykv.errors import ProfileError
from polykv.profiling.profile import Profile, StatTable


def _same(base: Profile, extra: Profile, field: str, a, b) -> None:
    if a != b:
        raise ProfileError(f"{extra.source}: field '{field}' is {b!r} but {base.source} has {a!r}; only "
                           f"calibrations of the same model on the same sequences merge (calibrate the new rules "
                           f"with the base profile's settings)")


def _merge_stat(base: Profile, extra: Profile, name: str, a: StatTable, b: StatTable) -> StatTable | None:
    """The two tables of statistic ``name`` as one; None when it summarises each profile's own configs (it differs
    on columns that are not rules, e.g. ``l2_kl_correlation``) and so holds for neither merged set."""
    for field in ("higher_is_better", "phase", "capacity"):
        _same(base, extra, f"stats.{name}.{field}", getattr(a, field), getattr(b, field))
    rules = {c.rule for c in base.configs} | {c.rule for c in extra.configs}
    new = [i for i, c in enumerate(b.columns) if c not in a.columns]
    for i, c in enumerate(b.columns):
        if c in a.columns and not np.allclose(a.values[:, a.columns.index(c)], b.values[:, i], rtol=1e-6, atol=1e-9,
                                              equal_nan=True):
            if c not in rules:
                return None
            raise ProfileError(f"{extra.source}: stats.{name} column '{c}' differs from {base.source}'s; the two "
                               f"calibrations did not see the same sequences")
    if not new:
        return a
    return attrs.evolve(a, columns=a.columns + tuple(b.columns[i] for i in new),
                        values=np.concatenate([a.values, b.values[:, new]], axis=1))


def merge_profiles(base: Profile, extra: Profile) -> Profile:
    """``base`` with ``extra``'s configs and per-rule statistics added (see the module docstring)."""
    for field in ("fingerprint", "num_layers", "num_kv_heads", "head_dim", "num_heads"):
        _same(base, extra, f"model.{field}", getattr(base.model, field), getattr(extra.model, field))
    for field in ("corpus", "seed", "context_tokens", "dtype"):
        _same(base, extra, f"provenance.{field}", getattr(base.provenance, field), getattr(extra.provenance, field))
    _same(base, extra, "quantizer", base.quantizer, extra.quantizer)
    _same(base, extra, "quantizer_params", base.quantizer_params, extra.quantizer_params)
    _same(base, extra, "metrics", sorted(base.metrics), sorted(extra.metrics))
    _same(base, extra, "objective_weights", base.objective_weights, extra.objective_weights)
    _same(base, extra, "head_metrics", sorted(base.head_metrics or {}), sorted(extra.head_metrics or {}))
    if extra.pairs is not None:
        raise ProfileError(f"{extra.source}: has a layer-pair table; merge only rule configs into a profile "
                           f"(calibrate the pairs into the base)")
    labels = {c.label: i for i, c in enumerate(base.configs)}
    twice = [(i, labels[c.label]) for i, c in enumerate(extra.configs) if c.label in labels]
    differ = [extra.configs[i].label for i, j in twice
              if not all(np.allclose(extra.metrics[k][:, i], base.metrics[k][:, j], rtol=1e-6, atol=1e-9)
                         for k in base.metrics)]
    if differ:
        raise ProfileError(f"{extra.source}: configs {differ[:3]}{' ...' if len(differ) > 3 else ''} are already in "
                           f"{base.source} with other values; leave their rules out of --rules")
    new = [i for i in range(len(extra.configs)) if extra.configs[i].label not in labels]  # (equal repeats, e.g.
    # the keep-everything configs every calibration measures, are kept once)
    metrics = {k: np.concatenate([base.metrics[k], extra.metrics[k][:, new]], axis=1) for k in base.metrics}
    stats, dropped = dict(base.stats), []
    for name, table in extra.stats.items():
        merged = _merge_stat(base, extra, name, stats[name], table) if name in stats else table
        if merged is None:
            del stats[name]
            dropped.append(name)
        else:
            stats[name] = merged
    rules = sorted({extra.configs[i].rule for i in new})
    created = extra.provenance.created or "an unrecorded time"
    note = f"{base.provenance.note}; rules {', '.join(rules)} added from a calibration of {created}" + (
        f" (dropped {', '.join(dropped)}: it summarised each calibration's own configs)" if dropped else "")
    heads = None if base.head_metrics is None else {
        k: np.concatenate([base.head_metrics[k], extra.head_metrics[k][:, :, new]], axis=2) for k in base.head_metrics}
    return attrs.evolve(base, configs=base.configs + tuple(extra.configs[i] for i in new), metrics=metrics, stats=stats,
                        head_metrics=heads,
                        provenance=attrs.evolve(base.provenance, note=note,
                                                extends=base.provenance.extends + (base.fingerprint,)))
