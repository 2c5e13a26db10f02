"""``uniform`` and ``quant-only``: the homogeneous baselines of MoE-nD (arXiv 2604.17695).

``uniform`` has three modes:

* ``best`` (default): the single profiled config with the lowest summed loss whose uniform plan fits.
* ``1d``: uniform eviction at the token budget b (the budget's 16-bit tokens per layer), 16 bits.
  Every layer keeps exactly ``b`` tokens with one rule.
* ``2d_uniform``: ``1d`` plus K8/V4 (``k_bits``/``v_bits``) on every layer: the same ``b`` tokens,
  fewer bytes than the budget.

In ``1d`` / ``2d_uniform`` the rule is ``rule``, or else the one whose profiled configs at those
bits have the lowest summed loss at the largest profiled keep not above b/T. ``predicted_loss`` is
the profile's value when b equals a profiled capacity, else null (b/T was not measured).

``quant-only`` is MoE-nD's ``2d``: per-layer K/V widths with uniform eviction at b*4/1.5 tokens,
the token count a K8/V4 cache affords in the 16-bit budget. Here the keep ratio is the largest
*profiled* keep of the rule whose K8/V4 plan fits (``ref_k_bits``/``ref_v_bits``), or ``keep``,
so that every loss is measured; then each layer's (K, V) widths among that rule's configs at that
keep are chosen exactly (multiple-choice knapsack) to minimise the summed loss within the budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polykv.errors import SolverError
from polykv.plan import FULL_OP, OpSpec
from polykv.profiling.budget import Budget, slot_bits, tokens_for_keep
from polykv.profiling.profile import Profile
from polykv.solvers.base import Solver, config_bits, min_bytes_message
from polykv.solvers.exact import candidate_columns, optimal_columns

MODES = ("best", "1d", "2d_uniform")


def _rule_choice(profile: Profile, table: np.ndarray, rule: str | None, kb: int, vb: int, keep_cap: float,
                 solver: str) -> int:
    """Column of the config that names the rule (and phase/params) for a token-budget uniform plan."""
    cols = [i for i, c in enumerate(profile.configs) if c.k_bits == kb and c.v_bits == vb and not c.keeps_everything
            and (rule is None or c.rule == rule)]
    if not cols:
        raise SolverError(f"solver '{solver}': the profile has no eviction config at K{kb} V{vb}"
                          + (f" for rule '{rule}'" if rule else "") + "; give --param rule=NAME of a profiled rule")
    keeps = sorted({profile.configs[i].keep for i in cols})
    below = [k for k in keeps if k <= keep_cap + 1e-12]
    at = below[-1] if below else keeps[0]
    at_cols = [i for i in cols if profile.configs[i].keep == at]
    return min(at_cols, key=lambda i: (float(table[:, i].sum()), i))


class Uniform(Solver):
    """The same config on every layer (see the module docstring for the modes)."""

    name = "uniform"
    defaults = {"mode": "best", "metric": None, "rule": None, "rules": None, "k_bits": 8, "v_bits": 4}
    paper = "MoE-nD baselines 1d / 2d_uniform, arXiv 2604.17695"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        if p["mode"] not in MODES:
            raise SolverError(f"solver 'uniform': unknown mode {p['mode']!r}; use one of {', '.join(MODES)}")
        table = profile.table(p["metric"])
        L, model, T = profile.num_layers, profile.model, budget.context_tokens
        if p["mode"] == "best":
            cols = candidate_columns(self, profile, p["rules"] if p["rule"] is None else [p["rule"]])
            bits = config_bits(profile, T)
            fits = [c for c in cols if L * bits[c] <= budget.to_bits(model)]
            if not fits:
                need = int(L * bits[cols].min())
                raise SolverError(min_bytes_message(self.name, need, budget, "the lightest config on every layer"))
            best = min(fits, key=lambda c: (float(table[:, c].sum()), int(bits[c]), int(c)))
            layers = [self.layer_entry(profile.configs[best], f"layer {i}") for i in range(L)]
            return self.plan(profile, budget, layers, p, predicted_loss=float(table[:, best].sum()),
                             predicted_bits=int(L * bits[best]), note=f"config {profile.configs[best].label}")
        b = budget.uniform_tokens(model)
        if b < 1:
            raise SolverError(min_bytes_message(self.name, L * slot_bits(model, 16, 16), budget,
                                                "one token per layer at 16 bits"))
        kb, vb = (16, 16) if p["mode"] == "1d" else (int(p["k_bits"]), int(p["v_bits"]))
        ref = _rule_choice(profile, table, p["rule"], kb, vb, b / T, self.name)
        cfg = profile.configs[ref]
        loss = None
        if b >= T:
            entry, tokens = {"prefill": FULL_OP, "decode": FULL_OP}, T
        else:
            self.check_phase(cfg.rule, cfg.phase, f"config {cfg.label}")
            op = OpSpec(rule=cfg.rule, capacity=b, params=cfg.params)
            entry, tokens = {"prefill": op if cfg.phase in ("prefill", "both") else FULL_OP,
                             "decode": op if cfg.phase in ("decode", "both") else FULL_OP}, b
        same = [i for i, c in enumerate(profile.configs) if c.k_bits == kb and c.v_bits == vb
                and tokens_for_keep(c.keep, T) == tokens and (c.rule == cfg.rule or c.keeps_everything)]
        if same:
            loss = float(table[:, same[0]].sum())
        layers = [{**entry, "k_bits": kb, "v_bits": vb} for _ in range(L)]
        return self.plan(profile, budget, layers, {**p, "rule": cfg.rule}, predicted_loss=loss,
                         predicted_bits=L * tokens * slot_bits(model, kb, vb),
                         note=f"{p['mode']}: {tokens} tokens per layer" + ("" if same else "; loss not profiled at "
                                                                             "this capacity"))


class QuantOnly(Solver):
    """MoE-nD's ``2d``: one profiled keep for all layers, per-layer K/V widths chosen exactly."""

    name = "quant-only"
    defaults = {"rule": None, "metric": None, "keep": None, "ref_k_bits": 8, "ref_v_bits": 4}
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
        cols = candidate_columns(self, profile, [rule])
        keeps = sorted({profile.configs[c].keep for c in cols})
        keep = p["keep"]
        if keep is None:
            per_layer = slot_bits(model, int(p["ref_k_bits"]), int(p["ref_v_bits"]))
            fit = [k for k in keeps if L * tokens_for_keep(k, T) * per_layer <= budget.to_bits(model)]
            if not fit:
                need = L * tokens_for_keep(keeps[0], T) * per_layer
                raise SolverError(min_bytes_message(self.name, need, budget, f"keep {keeps[0]:g} at "
                                                    f"K{p['ref_k_bits']} V{p['ref_v_bits']}"))
            keep = fit[-1]
        elif float(keep) not in keeps:
            raise SolverError(f"solver '{self.name}': keep {keep} is not profiled for rule '{rule}'; "
                              f"profiled keeps: {keeps}")
        at = np.asarray([c for c in cols if profile.configs[c].keep == float(keep)], np.int64)
        chosen, loss, used = optimal_columns(self, profile, budget, table, at,
                                             f"keep {float(keep):g} at the lowest widths")
        layers = [self.layer_entry(profile.configs[c], f"layer {i}") for i, c in enumerate(chosen)]
        return self.plan(profile, budget, layers, {**p, "rule": rule, "keep": float(keep)}, predicted_loss=loss,
                         predicted_bits=used, note=f"uniform keep {float(keep):g}, per-layer K/V widths")
