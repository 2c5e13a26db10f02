"""``uniform`` and ``quant-only``: the homogeneous baselines of MoE-nD (arXiv 2604.17695), filling their budget.

A uniform plan runs one rule at one keep ratio and one (K, V) width pair on every layer. The keep is
not taken from the profile's grid: at each width pair it is the *largest* keep whose uniform plan
fits the budget (counted on the budget's basis), so a baseline uses its whole budget, like the plans
it is compared with. Its loss is the profile's, linearly interpolated in keep between the two
profiled keeps around it (the keep-1.0 ``full`` config at the same widths closes the range); below
the lowest profiled keep the loss is unknown and such a candidate ranks last.

``uniform`` has three modes, each the candidate (rule, K, V) with the lowest interpolated summed loss:

* ``best`` (default): over every profiled rule (or ``rules``) and every profiled width pair.
* ``1d``: at 16 bits (no quantization), over ``rule`` (or every rule): uniform eviction.
* ``2d_uniform``: over every profiled width pair of ``rule`` (or every rule); ``k_bits``/``v_bits``
  fix the pair instead. The best uniform (keep, K, V) that fits.

``quant-only`` is MoE-nD's ``2d``: one keep for every layer, per-layer K/V widths. The keep is the
largest at which a uniform ``ref_k_bits``/``ref_v_bits`` (K8/V4) plan fits, MoE-nD's ``b * 4 / 1.5``
tokens on the nominal basis (or ``keep`` when given); then each layer's (K, V) pair is chosen exactly
(multiple-choice knapsack) on the interpolated per-layer losses at that keep, within the budget.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from polykv.errors import SolverError
from polykv.contract.params import ParamSpec
from polykv.plan import FULL_OP, LayerPlan, OpSpec
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile
from polykv.profiling.profile_checks import BITS, MIN_KEEP
from polykv.solvers.base import METRIC_SPEC, RULE_SPEC, Solver, min_bytes_message
from polykv.solvers.mckp import Infeasible, solve_mckp

MODES = ("best", "1d", "2d_uniform")


class Template(NamedTuple):
    """An eviction rule as profiled: name, phase and parameters (one column family of the profile)."""

    rule: str
    phase: str
    params_key: str


def template_of(c) -> Template:
    """The eviction template (rule, phase, parameters) config ``c`` belongs to."""
    import json

    return Template(c.rule, c.phase, json.dumps(c.params, sort_keys=True))


def templates(profile: Profile, rules: Any, solver: str) -> list[Template]:
    """Distinct eviction templates of the profile among ``rules`` (None = all), sorted."""
    if isinstance(rules, str):
        rules = [r for r in rules.split(",") if r]
    found = sorted({template_of(c) for c in profile.configs if not c.keeps_everything
                    and (rules is None or c.rule in rules)})
    if not found:
        have = sorted({c.rule for c in profile.configs if not c.keeps_everything})
        raise SolverError(f"solver '{solver}': no eviction config of rules {rules} in the profile; it has {have} "
                          "(give --param rule=NAME of a profiled rule)")
    return found


def width_pairs(profile: Profile, tpl: Template) -> list[tuple[int, int]]:
    return sorted({(c.k_bits, c.v_bits) for c in profile.configs if not c.keeps_everything and template_of(c) == tpl})


def interpolated_loss(profile: Profile, table: np.ndarray, tpl: Template, kb: int, vb: int,
                      keep: float) -> np.ndarray | None:
    """[L] loss of ``tpl`` at ``keep`` and widths (kb, vb), linear in keep between profiled keeps.

    The keep-1.0 config at (kb, vb), if profiled, closes the range; None below the lowest profiled keep.
    """
    points = {}
    for i, c in enumerate(profile.configs):
        if c.k_bits != kb or c.v_bits != vb:
            continue
        if c.keeps_everything:
            points.setdefault(1.0, i)
        elif template_of(c) == tpl:
            points[float(c.keep)] = i
    keeps = sorted(points)
    if not keeps or keep < keeps[0] - 1e-12 or keep > keeps[-1] + 1e-12:
        return None
    for lo, hi in zip(keeps, keeps[1:]):
        if lo - 1e-12 <= keep <= hi + 1e-12:
            w = 0.0 if hi == lo else min(max((keep - lo) / (hi - lo), 0.0), 1.0)
            return (1 - w) * table[:, points[lo]] + w * table[:, points[hi]]
    return table[:, points[keeps[0]]].copy()


def rule_layer(solver: Solver, tpl: Template, tokens: int, kb: int, vb: int, T: int, params: dict,
               profile: Profile) -> LayerPlan:
    """A layer running ``tpl`` in its phase(s) at ``tokens`` capacity (``full`` ops once it holds T), its
    widths stored with the profile's quantizer."""
    stored = {"k_bits": kb, "v_bits": vb, **profile.quantizer_fields()}
    if tokens >= T:
        return LayerPlan(layer=0, **stored)
    solver.check_phase(tpl.rule, tpl.phase, f"rule '{tpl.rule}'")
    op = OpSpec(rule=tpl.rule, capacity=int(tokens), params=params)
    return LayerPlan(layer=0, prefill=op if tpl.phase in ("prefill", "both") else FULL_OP,
                     decode=op if tpl.phase in ("decode", "both") else FULL_OP, **stored)


def _stored(profile: Profile) -> LayerPlan:
    """A layer that holds its tokens with the profile's quantizer and no rule state (for a minimum cost)."""
    return LayerPlan(layer=0, **profile.quantizer_fields())


def _params(profile: Profile, tpl: Template) -> dict:
    return dict(next(c.params for c in profile.configs if not c.keeps_everything and template_of(c) == tpl))


def fill_tokens(solver: Solver, profile: Profile, budget: Budget, tpl: Template, kb: int, vb: int) -> int:
    """Largest tokens per layer a uniform plan of ``tpl`` at (kb, vb) holds within ``budget`` (at most T)."""
    T = budget.context_tokens
    layer = rule_layer(solver, tpl, 1, kb, vb, T + 1, _params(profile, tpl), profile)
    if not budget.resident:
        return min(budget.uniform_tokens(profile.model, kb, vb), T)
    return budget.uniform_tokens(profile.model, kb, vb, layer=layer, registry=solver.registry)


class Candidate(NamedTuple):
    tpl: Template
    k_bits: int
    v_bits: int
    tokens: int
    loss: np.ndarray | None


def candidates(solver: Solver, profile: Profile, budget: Budget, table: np.ndarray, tpls: list[Template],
               pairs: list[tuple[int, int]] | None) -> list[Candidate]:
    """Every (template, width pair) at its largest fitting keep, with its interpolated per-layer loss."""
    T = budget.context_tokens
    out = []
    for tpl in tpls:
        for kb, vb in (pairs if pairs is not None else width_pairs(profile, tpl)):
            t = fill_tokens(solver, profile, budget, tpl, kb, vb)
            if t >= 1:
                out.append(Candidate(tpl, kb, vb, t, interpolated_loss(profile, table, tpl, kb, vb, t / T)))
    return out


class Uniform(Solver):
    """The same rule, keep and widths on every layer, at the largest keep that fits (module docstring)."""

    name = "uniform"
    defaults = {"mode": "best", "metric": None, "rule": None, "rules": None, "k_bits": None, "v_bits": None}
    param_specs = {"mode": ParamSpec(str, choices=MODES, description="which uniform baseline"),
                   "metric": METRIC_SPEC, "rule": RULE_SPEC,
                   "k_bits": ParamSpec(int, choices=BITS, nullable=True, description="key width"),
                   "v_bits": ParamSpec(int, choices=BITS, nullable=True, description="value width")}
    rule_lists = ("rules",)
    paper = "MoE-nD baselines 1d / 2d_uniform, arXiv 2604.17695"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        if p["mode"] not in MODES:
            raise SolverError(f"solver 'uniform': unknown mode {p['mode']!r}; use one of {', '.join(MODES)}")
        table = profile.table(p["metric"])
        L, T = profile.num_layers, budget.context_tokens
        rules = [p["rule"]] if p["rule"] is not None else p["rules"]
        tpls = templates(profile, rules, self.name)
        if p["mode"] == "1d":
            pairs = [(16, 16)]
        elif p["k_bits"] is not None or p["v_bits"] is not None:
            pairs = [(int(p["k_bits"] or 16), int(p["v_bits"] or 16))]
        else:
            pairs = None
        found = candidates(self, profile, budget, table, tpls, pairs)
        if not found:
            need = min(budget.capacity_bits(profile.model, _stored(profile), 1, kb, vb)
                       for kb, vb in (pairs or [(4, 4)]))
            raise SolverError(min_bytes_message(self.name, L * need, budget, "one token per layer"))
        best = min(found, key=lambda c: (c.loss is None, float(c.loss.sum()) if c.loss is not None else -c.tokens,
                                         -c.tokens, c.tpl, c.k_bits, c.v_bits))
        layer = rule_layer(self, best.tpl, best.tokens, best.k_bits, best.v_bits, T, _params(profile, best.tpl),
                           profile)
        loss = None if best.loss is None else float(best.loss.sum())
        keep = min(best.tokens, T) / T
        note = (f"{p['mode']}: {best.tpl.rule} keep {keep:.4g} ({best.tokens} of {T} tokens) K{best.k_bits} "
                f"V{best.v_bits}, the largest keep that fits; "
                + ("loss interpolated between profiled keeps" if loss is not None else
                   "loss not profiled below the lowest profiled keep"))
        return self.plan(profile, budget, [layer] * L, {**p, "rule": best.tpl.rule, "k_bits": best.k_bits,
                                                         "v_bits": best.v_bits, "keep": keep},
                         predicted_loss=loss, predicted_bits=0, note=note)


class QuantOnly(Solver):
    """MoE-nD's ``2d``: one keep for all layers (the largest a K8/V4 plan fits), per-layer K/V widths chosen exactly."""

    name = "quant-only"
    defaults = {"rule": None, "metric": None, "keep": None, "ref_k_bits": 8, "ref_v_bits": 4}
    param_specs = {"rule": RULE_SPEC, "metric": METRIC_SPEC,
                   "keep": ParamSpec(float, low=MIN_KEEP, high=1, nullable=True, description="the one keep ratio, "
                                     "in (0, 1]; null: the largest a K8/V4 plan fits"),
                   "ref_k_bits": ParamSpec(int, choices=BITS, description="key width the keep is fitted at"),
                   "ref_v_bits": ParamSpec(int, choices=BITS, description="value width the keep is fitted at")}
    paper = "MoE-nD 2d baseline, arXiv 2604.17695"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        table = profile.table(p["metric"])
        L, model, T = profile.num_layers, profile.model, budget.context_tokens
        rules = sorted({c.rule for c in profile.configs if not c.keeps_everything})
        rule = p["rule"]
        if rule is None:
            if len(rules) != 1:
                raise SolverError(f"solver '{self.name}': the profile has rules {rules}; choose one with "
                                  "--param rule=NAME")
            rule = rules[0]
        tpls = templates(profile, [rule], self.name)
        ref = (int(p["ref_k_bits"]), int(p["ref_v_bits"]))
        if p["keep"] is None:
            ref_fit = candidates(self, profile, budget, table, tpls, [ref])
            if not ref_fit:
                need = budget.capacity_bits(model, _stored(profile), 1, *ref)
                raise SolverError(min_bytes_message(self.name, L * need, budget,
                                                    f"one token per layer at K{ref[0]} V{ref[1]}"))
            pick = min(ref_fit, key=lambda c: (c.loss is None, float(c.loss.sum()) if c.loss is not None else 0,
                                               c.tpl))
            tpl, tokens = pick.tpl, pick.tokens
        else:
            keep = float(p["keep"])
            if not 0 < keep <= 1:
                raise SolverError(f"solver '{self.name}': keep must be in (0, 1], got {p['keep']!r}")
            tpl, tokens = tpls[0], max(1, int(np.ceil(keep * T - 1e-9)))
        keep = min(tokens, T) / T
        rule_params = _params(profile, tpl)
        pairs, losses = [], []
        for kb, vb in width_pairs(profile, tpl):
            loss = interpolated_loss(profile, table, tpl, kb, vb, keep)
            if loss is not None:
                pairs.append((kb, vb))
                losses.append(loss)
        if not pairs:
            raise SolverError(f"solver '{self.name}': keep {keep:.4g} is below every profiled keep of rule "
                              f"'{rule}'; raise the budget or give --param keep=K within the profiled range")
        layers = [rule_layer(self, tpl, tokens, kb, vb, T, rule_params, profile) for kb, vb in pairs]
        bits = np.array([budget.layer_bits(model, lp, self.registry) for lp in layers], np.int64)
        try:
            choice, loss, used = solve_mckp(np.stack(losses, axis=1), bits, budget.to_bits(model))
        except Infeasible as exc:
            raise SolverError(min_bytes_message(self.name, exc.need, budget,
                                                f"keep {keep:.4g} at the lowest widths")) from None
        return self.plan(profile, budget, [layers[int(c)] for c in choice],
                         {**p, "rule": rule, "keep": keep}, predicted_loss=loss, predicted_bits=used,
                         note=f"uniform keep {keep:.4g} ({tokens} of {T} tokens), per-layer K/V widths; "
                              "losses interpolated between profiled keeps")
