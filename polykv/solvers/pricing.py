"""The price of one layer setting from a profile: its predicted loss and its bytes, on the profile's grid or
between its points.

A profile measures each rule at a grid of keeps and K/V widths. :func:`price_config` prices any config of a
profiled rule (same phase and parameters): a grid point reads the profile's table; a keep between two profiled
keeps is interpolated linearly in keep, as the ``uniform`` solver predicts its own plans
(:func:`polykv.solvers.uniform.interpolated_loss`; the keep-everything config at the same widths closes the
range); a K or V width between two profiled widths is interpolated linearly in bits between them (bilinear when
both are off the grid). The loss is None where the profile cannot say: another rule, phase or parameters, a keep
below the lowest profiled one, a width outside the profiled range. :func:`layer_loss` prices a plan's layer the
same way; the study report sums it over layers (:func:`polykv.studies.predicted.profile_loss`).

>>> price = price_config(profile, 3, CandidateConfig(rule="snapkv", keep=0.3, k_bits=6, v_bits=4),
...                      budget=4096)  # doctest: +SKIP
>>> price.loss, price.bytes, price.how  # doctest: +SKIP
"""

from __future__ import annotations

import json

import attrs
import numpy as np

from polykv.errors import SolverError
from polykv.plan import LayerPlan, OpSpec
from polykv.profiling.budget import Budget, bits_to_bytes
from polykv.profiling.profile import CandidateConfig, Profile
from polykv.solvers.base import Solver
from polykv.solvers.uniform import Template, interpolated_loss


@attrs.define(frozen=True, kw_only=True)
class Price:
    """What one layer setting costs by the profile."""

    loss: float | None
    """Predicted loss of the layer under the config (the profile's metric); None where the profile cannot say."""
    bytes: int
    """Bytes the layer holds at the budget's context, on the budget's basis."""
    how: str
    """``measured`` (a grid point), ``interpolated`` (between grid points: in keep, in bits, or both), or why
    the loss is unknown."""


def _resolve(keep: float, T: int) -> int:
    return OpSpec(rule="x", capacity_ratio=float(keep)).resolve_capacity(T) if keep < 1.0 else T


def _column(profile: Profile, config: CandidateConfig, T: int) -> int | None:
    """The profile column measuring exactly ``config`` at ``T`` tokens (the same kept tokens), else None."""
    for j, c in enumerate(profile.configs):
        if (c.k_bits, c.v_bits) != (config.k_bits, config.v_bits) or c.low_rank:
            continue
        if c.keeps_everything or config.keeps_everything:
            if c.keeps_everything and config.keeps_everything:
                return j
            continue
        if (c.rule, c.phase, dict(c.params)) == (config.rule, config.phase, dict(config.params)) and \
                _resolve(c.keep, T) == _resolve(config.keep, T):
            return j
    return None


def _between(values: list[int], x: int) -> tuple[int, int, float] | None:
    """(lo, hi, weight of hi) of ``x`` among sorted grid ``values``; None outside them."""
    if not values or x < values[0] or x > values[-1]:
        return None
    if x in values:
        return x, x, 0.0
    hi = next(v for v in values if v > x)
    lo = max(v for v in values if v < x)
    return lo, hi, (x - lo) / (hi - lo)


def _interpolated(profile: Profile, table: np.ndarray, layer: int, config: CandidateConfig,
                  keep: float) -> tuple[float | None, str]:
    if config.keeps_everything:
        widths = {(c.k_bits, c.v_bits): j for j, c in enumerate(profile.configs)
                  if c.keeps_everything and not c.low_rank}
        def at(kb, vb):  # noqa: E306
            return None if (kb, vb) not in widths else float(table[layer, widths[(kb, vb)]])
    else:
        tpl = Template(config.rule, config.phase, json.dumps(dict(config.params), sort_keys=True))
        widths = {(c.k_bits, c.v_bits) for c in profile.configs if not c.keeps_everything and not c.low_rank
                  and (c.rule, c.phase, json.dumps(c.params, sort_keys=True)) == tpl}
        if not widths:
            return None, f"rule '{config.rule}' in phase '{config.phase}' with these parameters is not in the profile"

        def at(kb, vb):
            if (kb, vb) not in widths:
                return None
            per_layer = interpolated_loss(profile, table, tpl, kb, vb, keep)
            return None if per_layer is None else float(per_layer[layer])
    ks = _between(sorted({k for k, _ in widths}), config.k_bits)
    vs = _between(sorted({v for _, v in widths}), config.v_bits)
    if ks is None or vs is None:
        return None, (f"K{config.k_bits}/V{config.v_bits} lies outside the profiled widths "
                      f"{sorted(widths)}")
    (k0, k1, wk), (v0, v1, wv) = ks, vs
    corners = [(at(k, v), w) for k, v, w in ((k0, v0, (1 - wk) * (1 - wv)), (k1, v0, wk * (1 - wv)),
                                              (k0, v1, (1 - wk) * wv), (k1, v1, wk * wv)) if w > 0]
    if any(loss is None for loss, _ in corners):
        return None, (f"keep {keep:g} at K{config.k_bits}/V{config.v_bits} is not between profiled points "
                      "(below the lowest profiled keep, or a width pair around it was not profiled)")
    return float(sum(loss * w for loss, w in corners)), "interpolated"


def price_config(profile: Profile, layer: int, config: CandidateConfig, *, budget: Budget | int,
                 metric: str | None = None, registry=None) -> Price:
    """Predicted loss and bytes of ``layer`` running ``config`` (on the profile's grid or between its points).

    Parameters
    ----------
    profile : Profile
        The profile whose table prices the loss (``metric``, default its routing metric).
    layer : int
        The layer, 0-based.
    config : CandidateConfig
        Any keep in (0, 1] and K/V widths of a profiled rule, phase and parameters (full rank).
    budget : Budget or int
        The context and basis the bytes are counted on; a context length in tokens counts nominal bytes.
    """
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < profile.num_layers:
        raise SolverError(f"{profile.source}: layer {layer!r} is out of range; the profile has layers 0 to "
                          f"{profile.num_layers - 1}")
    if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
        budget = Budget(kind="ratio", value=1.0, context_tokens=int(budget), basis="nominal")
    if not isinstance(budget, Budget):
        raise SolverError(f"price_config: budget {budget!r} is neither a Budget nor a context length in tokens; pass "
                          "Budget.parse('8x', T) or T")
    T = budget.context_tokens
    solver = Solver(registry=registry)
    bits = budget.layer_bits(profile.model, solver.config_layer(config, f"config {config.label}", profile=profile),
                             solver.registry)
    table = profile.table(metric)
    column = _column(profile, config, T)
    if column is not None:
        return Price(loss=float(table[int(layer), column]), bytes=bits_to_bytes(bits), how="measured")
    loss, how = _interpolated(profile, table, int(layer), config, min(_resolve(config.keep, T), T) / T)
    return Price(loss=loss, bytes=bits_to_bytes(bits), how=how)


def layer_config(lp: LayerPlan, context_tokens: int) -> CandidateConfig | None:
    """The config a plan layer runs at ``context_tokens`` (its kept tokens as a keep), or None when its two phases
    run different rules or the layer stores a low-rank projection (no single config describes it)."""
    if lp.k_rank is not None or lp.v_rank is not None or context_tokens < 1:
        return None
    ops = [op for op in (lp.prefill, lp.decode) if not op.keeps_everything]
    if not ops:
        return CandidateConfig(rule="full", keep=1.0, k_bits=lp.k_bits, v_bits=lp.v_bits)
    if len(ops) == 2 and ops[0] != ops[1]:
        return None
    op = ops[0]
    phase = "both" if len(ops) == 2 else ("prefill" if lp.decode.keeps_everything else "decode")
    keep = min(op.resolve_capacity(context_tokens), context_tokens) / context_tokens
    return CandidateConfig(rule=op.rule, keep=keep, phase=phase, k_bits=lp.k_bits, v_bits=lp.v_bits,
                           params=dict(op.params))


def layer_loss(profile: Profile, table: np.ndarray, lp: LayerPlan, context_tokens: int) -> float | None:
    """The profile's loss of plan layer ``lp`` at ``context_tokens`` (``table`` one of its metric tables): a grid
    column when one measures exactly this setting (same kept tokens), else interpolated as :func:`price_config`."""
    config = layer_config(lp, context_tokens)
    if config is None:
        return None
    if not (lp.k_bits, lp.v_bits) == (16, 16):
        quant = profile.quantizer_fields()
        if (lp.quantizer, dict(lp.quantizer_params)) != (quant["quantizer"], quant["quantizer_params"]):
            return None
    column = _column(profile, config, context_tokens)
    if column is not None:
        return float(table[lp.layer, column])
    return _interpolated(profile, table, lp.layer, config, config.keep)[0]
