"""``pyramid``: the PyramidKV capacity schedule with SnapKV scoring.

PyramidKV (Cai et al., arXiv 2406.02069): lower layers keep more, upper layers less, in a linear
staircase around an average budget M (tokens per layer, window w included), beta = 20:

    min = floor((M - w) / beta);  max = 2 (M - w) - min
    if max >= T - w:  max = T - w;  min = 2 (M - w) - max
    step = floor((max - min) / (L - 1));  layer l keeps (max - l * step) + w

No compression when T < M; a uniform M (= (M - w) + w) per layer when T < 2 (M - w). M is the
budget's 16-bit tokens per layer. The floor in ``step`` can make the staircase sum exceed L * M by
up to L (L - 1) / 2 tokens; polykv removes that excess one token at a time from the largest
layers (lowest index first) so the plan stays within the budget, and says so in the plan's note.
Prefill only (SnapKV's phase); decode keeps everything. ``predicted_loss`` is null: a profile
measures keep ratios, not this schedule. When the rule declares a ``window`` parameter it is set
to ``w`` so scoring and schedule agree.
"""

from __future__ import annotations

from typing import Any

from polykv.errors import SolverError
from polykv.contract.params import ParamSpec
from polykv.plan import FULL_OP, MAX_CONTEXT_TOKENS, OpSpec
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile
from polykv.contract.schedules import pyramid_capacities, trim_to
from polykv.solvers.base import Solver, min_bytes_message


class Pyramid(Solver):
    """PyramidKV schedule (module docstring). Params: ``window`` 8, ``beta`` 20, ``rule`` snapkv, ``rule_params``."""

    name = "pyramid"
    defaults = {"window": 8, "beta": 20, "rule": "snapkv", "rule_params": None}
    param_specs = {
        "window": ParamSpec(int, low=1, high=MAX_CONTEXT_TOKENS, description="observation window in every layer's "
                            "budget, tokens"),
        "beta": ParamSpec(int, low=1, high=MAX_CONTEXT_TOKENS, description="ratio of the largest to the smallest "
                          "non-window budget's spread"),
        "rule": ParamSpec(str, description="the prefill rule every layer runs"),
        "rule_params": ParamSpec(dict, nullable=True, description="the rule's parameters"),
    }
    paper = "PyramidKV, arXiv 2406.02069"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        L, model, T = profile.num_layers, profile.model, budget.context_tokens
        M = budget.uniform_tokens(model)
        w = int(p["window"])
        if M < 1:
            raise SolverError(min_bytes_message(self.name, L * budget.token_bits(model), budget,
                                                "one token per layer at 16 bits"))
        caps = pyramid_capacities(L, T, M, window=w, beta=int(p["beta"]),
                                  fix="raise the budget or lower --param window")
        per_token = budget.token_bits(model)
        if caps is None:
            layers = [{"prefill": FULL_OP, "decode": FULL_OP}] * L
            return self.plan(profile, budget, layers, p, predicted_loss=None, predicted_bits=L * T * per_token,
                             note=f"T={T} < M={M}: no compression")
        self.check_phase(p["rule"], "prefill", f"solver '{self.name}'")
        caps, removed = trim_to(caps, budget.to_bits(model) // per_token)
        rule_params = dict(p["rule_params"] or {})
        if "window" in self.registry.rule(p["rule"]).defaults:
            rule_params.setdefault("window", w)
        layers = [{"prefill": FULL_OP if c >= T else OpSpec(rule=p["rule"], capacity=c, params=rule_params),
                   "decode": FULL_OP} for c in caps]
        bits = sum(min(c, T) for c in caps) * per_token
        note = f"capacities {caps[0]}..{caps[-1]}" + (f"; {removed} tokens trimmed to fit" if removed else "")
        return self.plan(profile, budget, layers, p, predicted_loss=None, predicted_bits=bits, note=note)
