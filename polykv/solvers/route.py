"""``profile-route`` and ``random-placement``: PolyKV's routing of the rule's identity per layer.

PolyKV (arXiv 2606.15157): each candidate rule is profiled at a common calibration capacity; a
per-(layer, rule) statistic ``g`` (cosine of the layer's mean output hidden state under full KV vs
under the rule, higher is better; or delta-PPL when only layer l uses the rule, lower is better)
ranks the rules, and the route is the top-ranked rule on every layer for the chosen scope
(``prefill``, ``decode``, or ``both`` = one rule that runs in both phases; inactive phases keep
everything). The total capacity per phase is fixed (L x the budget's 16-bit tokens per layer) and
split by ``allocation``:

* ``uniform``: the same tokens on every layer;
* ``entropy``: in proportion to the layer's attention entropy H_l (statistic ``entropy_statistic``);
* ``delta-ppl``: in proportion to max_r delta-PPL[l, r] (statistic ``delta_ppl_statistic``),
  clipped at its ``clip_percentile`` (95th) percentile over layers; negative scores count as 0.

Proportional splits give every layer one token first, then share the rest by the scores, never
above the context T (a layer at T keeps everything), evenly when the remaining scores are all zero,
rounding by largest remainders so the total is exact.

``random-placement`` builds the same route and capacities, then returns the ``index``-th of
``count`` unique, seeded random placements of the route's rules over the layers (method counts
fixed, the guided route itself excluded): the count-matched controls of the rank test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from polykv.solvers import placements
from polykv.errors import RegistryError, SolverError
from polykv.plan import FULL_OP, FULL_RULE, LayerPlan, OpSpec
from polykv.profiling.budget import Budget
from polykv.contract.params import ParamSpec
from polykv.profiling.profile import Profile
from polykv.solvers.base import Solver, min_bytes_message

ALLOCATIONS = ("uniform", "entropy", "delta-ppl")
SCOPES = ("prefill", "decode", "both")


def allocate(total: int, scores: np.ndarray, cap: int) -> list[int]:
    """Split ``total`` tokens over layers in proportion to ``scores``: at least 1, at most ``cap`` each.

    Negative scores count as 0; when every layer still below ``cap`` scores 0, the rest is shared evenly.
    Rounds by largest remainders (ties to the lower layer), so the result sums to ``min(total, L * cap)``.
    """
    L = len(scores)
    if total >= L * cap:
        return [cap] * L
    x = np.ones(L)
    rest, free = float(total - L), np.ones(L, bool)
    s = np.clip(np.asarray(scores, np.float64), 0.0, None)
    while rest > 1e-9 and free.any():
        w = s * free
        if w.sum() <= 0:
            w = free.astype(np.float64)  # no signal left among free layers: share the rest evenly
        add = rest * w / w.sum()
        room = cap - x
        add = np.minimum(add, room)
        x += add
        rest -= add.sum()
        free &= x < cap - 1e-9
    out = np.floor(x + 1e-9).astype(np.int64)
    short = int(total - out.sum())
    order = np.argsort(-(x - out), kind="stable")
    for i in order:
        if short <= 0:
            break
        if out[i] < cap:
            out[i] += 1
            short -= 1
    return [int(v) for v in out]


class ProfileRoute(Solver):
    """PolyKV route construction and allocation (module docstring)."""

    name = "profile-route"
    defaults = {"statistic": "cosine", "scope": None, "allocation": "uniform", "rules": None,
                "entropy_statistic": "entropy", "delta_ppl_statistic": "delta_ppl", "clip_percentile": 95.0}
    param_specs = {
        "statistic": ParamSpec(str, description="the stats table that ranks rules per layer"),
        "scope": ParamSpec(str, choices=SCOPES, nullable=True, description="phases the route covers"),
        "allocation": ParamSpec(str, choices=ALLOCATIONS, description="how layer budgets are shared"),
        "entropy_statistic": ParamSpec(str, description="the stats table of per-layer attention entropy"),
        "delta_ppl_statistic": ParamSpec(str, description="the stats table of per-(layer, rule) delta-PPL"),
        "clip_percentile": ParamSpec(float, low=0, high=100, description="delta-PPL clip, a percentile"),
    }
    rule_lists = ("rules",)
    paper = "PolyKV, arXiv 2606.15157"

    def route(self, profile: Profile, p: dict[str, Any]) -> tuple[str, list[str]]:
        """(scope, top-ranked rule per layer)."""
        st = profile.stat(p["statistic"])
        scope = p["scope"] or st.phase
        if scope not in SCOPES:
            raise SolverError(f"solver '{self.name}': unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
        needed = {"prefill", "decode"} if scope == "both" else {scope}
        rules = p["rules"]
        cols = []
        for j, rule in enumerate(st.columns):
            if rule == FULL_RULE or (rules is not None and rule not in rules):
                continue
            try:
                phases = self.registry.rule(rule).phases
            except RegistryError as exc:
                raise SolverError(f"{profile.source}: stats.{p['statistic']} column '{rule}': {exc}") from None
            if needed <= set(phases):  # rules that cannot run in the scope are not candidates
                cols.append(j)
        if not cols:
            raise SolverError(f"solver '{self.name}': no column of stats.{p['statistic']} ({list(st.columns)}) "
                              f"names a rule that runs in scope '{scope}'" + (f" among {rules}" if rules else ""))
        vals = st.values[:, cols]
        best = np.argmax(vals, axis=1) if st.higher_is_better else np.argmin(vals, axis=1)
        return scope, [st.columns[cols[int(b)]] for b in best]

    def capacities(self, profile: Profile, budget: Budget, p: dict[str, Any], scope: str | None = None,
                   route: list[str] | None = None) -> list[int]:
        """Tokens per layer; on the resident basis with a ``route``, the largest split whose plan (rule state
        included: accumulated attention, query windows) fits the budget."""
        L = profile.num_layers
        b = budget.uniform_tokens(profile.model)
        if b < 1:
            raise SolverError(min_bytes_message(self.name, L * budget.token_bits(profile.model), budget,
                                                "one token per layer at 16 bits"))
        if not budget.resident or route is None or self._fits(profile, budget, scope, route,
                                                              self._split(profile, budget, p, b)):
            return self._split(profile, budget, p, b)
        lo, hi = 0, b
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(profile, budget, scope, route, self._split(profile, budget, p, mid)):
                lo = mid
            else:
                hi = mid
        if lo < 1:
            raise SolverError(f"solver '{self.name}': the route's rule state alone exceeds the budget "
                              f"({budget.describe()}); raise the budget")
        return self._split(profile, budget, p, lo)

    def _fits(self, profile: Profile, budget: Budget, scope: str, route: list[str], caps: list[int]) -> bool:
        layers = self.route_layers(budget.context_tokens, scope, route, caps)
        used = sum(budget.layer_bits(profile.model, LayerPlan(layer=i, **e), self.registry)
                   for i, e in enumerate(layers))
        return used <= budget.to_bits(profile.model)

    @staticmethod
    def route_layers(T: int, scope: str, route: list[str], caps: list[int]) -> list[dict[str, Any]]:
        layers = []
        for rule, cap in zip(route, caps):
            op = FULL_OP if cap >= T else OpSpec(rule=rule, capacity=cap)
            layers.append({"prefill": op if scope in ("prefill", "both") else FULL_OP,
                           "decode": op if scope in ("decode", "both") else FULL_OP})
        return layers

    def _split(self, profile: Profile, budget: Budget, p: dict[str, Any], b: int) -> list[int]:
        L, T = profile.num_layers, budget.context_tokens
        alloc = p["allocation"]
        if alloc == "uniform":
            return [min(b, T)] * L
        if alloc == "entropy":
            st = profile.stat(p["entropy_statistic"])
            if len(st.columns) != 1:
                raise SolverError(f"solver '{self.name}': stats.{p['entropy_statistic']} must have one column "
                                  f"(per-layer entropy), it has {list(st.columns)}")
            scores = st.values[:, 0]
        elif alloc == "delta-ppl":
            per_layer = profile.stat(p["delta_ppl_statistic"]).values.max(axis=1)
            scores = np.minimum(per_layer, np.percentile(per_layer, float(p["clip_percentile"])))
        else:
            raise SolverError(f"solver '{self.name}': unknown allocation {alloc!r}; use one of "
                              f"{', '.join(ALLOCATIONS)}")
        return allocate(L * b, scores, T)

    def build(self, profile: Profile, budget: Budget, p: dict[str, Any], scope: str, route: list[str],
              caps: list[int], note: str):
        T = budget.context_tokens
        for rule in sorted(set(route)):
            self.check_phase(rule, scope, f"route rule '{rule}'")
        layers = self.route_layers(T, scope, route, caps)
        bits = sum(min(c, T) for c in caps) * budget.token_bits(profile.model)
        counts = ", ".join(f"{r} x{n}" for r, n in sorted(Counter(route).items()))
        return self.plan(profile, budget, layers, {**p, "scope": scope, "route": route}, predicted_loss=None,
                         predicted_bits=bits, note=f"{note}; {counts}")

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        scope, route = self.route(profile, p)
        return self.build(profile, budget, p, scope, route, self.capacities(profile, budget, p, scope, route),
                          f"guided route by {p['statistic']}, allocation {p['allocation']}")


def random_placements(route: list[str], count: int, seed: int) -> list[list[str]]:
    """``count`` unique seeded permutations of ``route`` (method counts fixed), never ``route`` itself
    (:func:`polykv.solvers.placements.random_placements`)."""
    try:
        return [list(pl) for pl in placements.random_placements(route, count, seed, exclude=[route])]
    except ValueError:
        available = placements.distinct_placements(route) - 1
        raise SolverError(f"random-placement: only {available} placements differ from the route {route}; "
                          f"ask for at most that many (--param count=N)") from None


class RandomPlacement(ProfileRoute):
    """Count-matched control: the ``index``-th of ``count`` seeded random placements of the guided route."""

    name = "random-placement"
    defaults = {**ProfileRoute.defaults, "route": None, "seed": 0, "count": 99, "index": 0}
    param_specs = {**ProfileRoute.param_specs,
                   "seed": ParamSpec(int, low=0, high=2 ** 63 - 1, description="seed of the placements"),
                   "count": ParamSpec(int, low=1, high=1 << 20, description="number of placements"),
                   "index": ParamSpec(int, low=0, high=1 << 20, description="which placement, 0 to count - 1")}

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        scope, route = self.route(profile, p)
        if p["route"] is not None:
            given = p["route"].split(",") if isinstance(p["route"], str) else list(p["route"])
            if len(given) != profile.num_layers:
                raise SolverError(f"random-placement: route lists {len(given)} rules for {profile.num_layers} layers")
            route = given
        count, index = int(p["count"]), int(p["index"])
        if not 0 <= index < count:
            raise SolverError(f"random-placement: index {index} is outside 0..{count - 1} (--param index=I)")
        placement = random_placements(route, count, int(p["seed"]))[index]
        return self.build(profile, budget, {**p, "guided_route": route}, scope, placement,
                          self.capacities(profile, budget, p, scope, placement),
                          f"random placement {index} of {count} (seed {p['seed']})")
