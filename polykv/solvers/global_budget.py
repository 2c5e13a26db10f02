"""``global``: a plan whose layers share one run-time budget over layers x KV heads (an allocation group).

KVzip's global level (the ``kvzip`` allocator) ranks every (layer, KV head, token) of its group by one score
after prefill, so heads and layers keep different counts of one total. What a plan decides ahead of time is
which layers join that group, the group's total (the sum of its members' planned capacities), and everything
the allocator does not move: each member's K/V widths and ranks, and the rule, keep, widths and ranks of every
layer outside the group. This solver decides them from the profile's losses (the routing metric: the
objective mix of a profile calibrated with ``--objectives``):

* **Members share one storage signature** (K bits, V bits, K rank, V rank): the allocator moves tokens between
  members, and a token costs the same bytes on every member only when they store it alike, so the planned
  bytes stay the bytes the runtime holds. Every signature the profile measured for the group's rule is tried
  (``k_bits`` / ``v_bits`` fix the widths) and the one with the lowest predicted loss kept.
* ``shares = "profile"`` (default): for each signature, the ``exact`` knapsack over the group rule's configs
  at that signature and every other allowed config (``rules``; keep-1.0 configs always stay). A layer whose
  optimum runs the group rule joins the group at that keep; the split of the total over the members is the
  one the profile prices best, a prior the allocator then re-ranks by its own scores. The predicted loss is
  the sum of the per-layer losses at the planned split.
* ``shares = "uniform"``: every layer joins at one keep, the largest whose uniform plan fits (as ``uniform``
  counts it); the loss is interpolated between profiled keeps. With ``k_bits=4 v_bits=4`` on SmolLM2 at 2,048
  tokens this is the plan ``bench/high_compression/make_kvzip_plans.py`` used to write by hand.

Window-bounded layers keep their window and join no group (:mod:`polykv.solvers.windowed`). The base class
recounts the bytes with every member at its planned capacity and checks the group as plan validation does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from polykv.contract.params import ParamSpec
from polykv.errors import RegistryError, SolverError
from polykv.plan import AllocationGroup
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile
from polykv.profiling.profile_checks import BITS
from polykv.solvers.base import METRIC_SPEC, RULE_SPEC, Solver
from polykv.solvers.exact import candidate_columns, check_axes_metric, optimal_columns, solve_columns
from polykv.solvers.uniform import fill_tokens, interpolated_loss, rule_layer, template_of
from polykv.solvers.windowed import whole_model, window_bounds

SHARES = ("profile", "uniform")


class Signature(NamedTuple):
    """How a group member stores its tokens: widths and ranks (None = full width)."""

    k_bits: int
    v_bits: int
    k_rank: int | None
    v_rank: int | None

    def describe(self) -> str:
        ranks = "" if self.k_rank is None and self.v_rank is None else \
            "/R" + "x".join("d" if r is None else str(r) for r in (self.k_rank, self.v_rank))
        return f"K{self.k_bits} V{self.v_bits}{ranks}"


class Outcome(NamedTuple):
    signature: Signature
    layers: list
    members: list[int]
    loss: float | None
    bits: int
    shared: str | None


def _signature(c) -> Signature:
    return Signature(int(c.k_bits), int(c.v_bits), c.k_rank, c.v_rank)


def _order(s: Signature) -> tuple:
    """Widest first: bits, then ranks (full width first)."""
    return (-s.k_bits, -s.v_bits, -(s.k_rank or 1 << 30), -(s.v_rank or 1 << 30))


class GlobalBudget(Solver):
    """Layers x heads under one allocator, the rest per layer, priced by the profile (module docstring)."""

    name = "global"
    defaults = {"allocator": None, "rule": None, "metric": None, "rules": None, "shares": "profile",
                "k_bits": None, "v_bits": None}
    param_specs = {"allocator": ParamSpec(str, nullable=True, description="a registered allocator (polykv plugins "
                                          "lists them)"),
                   "rule": RULE_SPEC, "metric": METRIC_SPEC,
                   "shares": ParamSpec(str, choices=SHARES, description="how the group's total is split in the plan"),
                   "k_bits": ParamSpec(int, choices=BITS, nullable=True, description="the members' key width"),
                   "v_bits": ParamSpec(int, choices=BITS, nullable=True, description="the members' value width")}
    rule_lists = ("rules",)
    routes_axes = True
    paper = "KVzip global (pair-level) budget, arXiv 2505.23416; exact multiple-choice knapsack per storage signature"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        if p["allocator"] is None:
            raise SolverError(f"solver '{self.name}': parameter 'allocator' is not set: name the allocator whose group the "
                              f"plan holds (--param allocator=NAME; registered: {_allocators(self)})")
        rule = p["rule"] or p["allocator"]
        check_pairing(self, p["allocator"], rule)
        profiled = sorted({c.rule for c in profile.configs if not c.keeps_everything})
        if rule not in profiled:
            why = "parameter 'rule'" if p["rule"] else f"the rule of allocator '{p['allocator']}'"
            raise SolverError(f"solver '{self.name}': the group's rule '{rule}' ({why}) has no configs in "
                              f"{profile.source}; it has {profiled}: calibrate it (polykv calibrate --rules {rule}) "
                              "or give --param rule=NAME")
        if p["rules"] is not None and rule not in p["rules"]:
            raise SolverError(f"solver '{self.name}': parameter 'rules' {list(p['rules'])} leaves out the group's rule "
                              f"'{rule}'; add it")
        check_axes_metric(self, profile, p["metric"])
        table = profile.table(p["metric"])
        cols = candidate_columns(self, profile, p["rules"])
        members = group_columns(profile, cols, rule)
        signatures = sorted({_signature(profile.configs[c]) for c in members}, key=_order)
        signatures = [s for s in signatures if (p["k_bits"] is None or s.k_bits == p["k_bits"])
                      and (p["v_bits"] is None or s.v_bits == p["v_bits"])]
        if not signatures:
            raise SolverError(f"solver '{self.name}': {profile.source} has no prefill config of rule '{rule}'"
                              + (f" at K{p['k_bits'] or '*'} V{p['v_bits'] or '*'}" if p["k_bits"] or p["v_bits"]
                                 else "") + "; give widths the profile measured for it")
        tried, failures = [], []
        heads_note = head_note(profile, p["metric"]) if p["shares"] == "profile" else None
        for sig in signatures:
            try:
                if p["shares"] == "uniform":
                    tried.append(self._uniform(profile, budget, table, rule, sig, members))
                else:
                    tried.append(self._profiled(profile, budget, table, cols, rule, sig, members, p["metric"]))
            except SolverError as exc:
                failures.append(exc)
        if not tried:
            raise failures[0]
        best = min(tried, key=lambda o: (o.loss is None, o.loss if o.loss is not None else 0.0, not o.members))
        group = (AllocationGroup(allocator=p["allocator"], layers=tuple(best.members)),) if best.members else ()
        note = (f"allocator {p['allocator']} over layers {_ranges(_model_layers(profile, best.members)) or 'none'} "
                f"(rule {rule}, {best.signature.describe()}, shares {p['shares']})"
                + ("; the other layers routed per layer" if len(best.members) < profile.num_layers else "")
                + f"; {len(tried)} member signature(s) compared")
        if best.shared is not None:
            note += f"; shared pairs: {best.shared}"
        if heads_note:
            note += f"; {heads_note}"
        return self.plan(profile, budget, best.layers, {**p, "rule": rule}, predicted_loss=best.loss,
                         predicted_bits=best.bits, note=note, allocation=group)

    def _profiled(self, profile, budget, table, cols, rule, sig, members, metric) -> Outcome:
        """The exact knapsack with the group rule at ``sig`` only; members are the layers that take it."""
        keep = signature_columns(profile, cols, rule, sig, members)
        table = head_priced(profile, table, metric, [int(c) for c in members if _signature(profile.configs[c]) == sig])
        layers, loss, used, shared = solve_columns(self, profile, budget, table, keep, metric)
        joined = [i for i, e in enumerate(layers) if _joins(e, rule)]
        return Outcome(sig, layers, joined, loss, used, shared)

    def _uniform(self, profile, budget, table, rule, sig, members) -> Outcome:
        """Every layer the group rule at one keep, the largest that fits at ``sig``."""
        if sig.k_rank is not None or sig.v_rank is not None:
            raise SolverError(f"solver '{self.name}': shares 'uniform' fills full-rank members only")
        tpl = template_of(profile.configs[members[0]])
        T, L = budget.context_tokens, profile.num_layers
        tokens = fill_tokens(self, profile, budget, tpl, sig.k_bits, sig.v_bits)
        if tokens < 1:
            raise SolverError(f"solver '{self.name}': not one token per layer of rule '{rule}' at {sig.describe()} "
                              f"fits the budget ({budget.describe()}); raise the budget")
        lp = rule_layer(self, tpl, tokens, sig.k_bits, sig.v_bits, T, dict(profile.configs[members[0]].params),
                        profile)
        loss = interpolated_loss(profile, table, tpl, sig.k_bits, sig.v_bits, min(tokens, T) / T)
        layers = [lp] * L
        joined = [] if lp.prefill.keeps_everything else list(range(L))
        return Outcome(sig, layers, joined, None if loss is None else float(loss.sum()), 0, None)


KEEP_UNITS = 1000
"""Keep ratios are compared in thousandths when the head shares are split (:func:`head_priced`)."""


def head_note(profile: Profile, metric: str | None) -> str | None:
    """What the plan's note says about head shares: priced from ``head_metrics``, or why not (None: no table)."""
    if not profile.head_metrics:
        return None
    name = metric or profile.default_metric
    if name in profile.head_metrics:
        return f"members priced at their best KV-head split (head_metrics.{name})"
    return (f"members priced per layer: head_metrics has no {name} table (it has "
            f"{', '.join(sorted(profile.head_metrics))})")


def head_priced(profile: Profile, table: np.ndarray, metric: str | None, columns: list[int]) -> np.ndarray:
    """``table`` with each group column (``columns``: one rule at one storage signature) priced at the allocator's
    best split over KV heads, when the profile has a per-head table of the metric (``head_metrics``).

    A member at keep k holds ``k * Hkv`` heads' worth of tokens, which the allocator may split unevenly: head h at
    keep k_h, ``mean_h k_h <= k``, each k_h one of the signature's keeps (or the keep-1.0 config at its widths).
    The per-head table gives each split's loss, ``sum_h head[l, h, c(k_h)]``; the best split (a knapsack over
    heads) lowers the layer's price by the same factor: ``table[l, c] * best / sum_h head[l, h, c]``. Without a
    per-head table of the metric the table is returned unchanged."""
    heads = (profile.head_metrics or {}).get(metric or profile.default_metric)
    if heads is None or not columns:
        return table
    first = profile.configs[columns[0]]
    full = [i for i, c in enumerate(profile.configs) if c.keeps_everything and (c.k_bits, c.v_bits, c.k_rank, c.v_rank)
            == (first.k_bits, first.v_bits, first.k_rank, first.v_rank)]
    options = [(round(profile.configs[c].keep * KEEP_UNITS), c) for c in columns + full[:1]]
    out = table.copy()
    L, H = heads.shape[:2]
    for layer in range(L):
        for c in columns:
            cap = round(profile.configs[c].keep * KEEP_UNITS) * H
            best = np.full(cap + 1, np.inf)   # best[u]: least loss of the heads so far using u keep units
            best[0] = 0.0
            for h in range(H):
                nxt = np.full(cap + 1, np.inf)
                for units, col in options:
                    if units <= cap:
                        nxt[units:] = np.minimum(nxt[units:], best[:cap + 1 - units] + heads[layer, h, col])
                best = nxt
            even = float(heads[layer, :, c].sum())
            if even > 0 and np.isfinite(best.min()):
                out[layer, c] = table[layer, c] * min(1.0, float(best.min()) / even)
    return out


def _allocators(solver: Solver) -> str:
    return ", ".join(sorted(e.name for e in solver.registry.entries() if e.kind == "allocator")) \
        or "none"


def check_pairing(solver: Solver, allocator: str, rule: str) -> None:
    """``allocator`` is registered and can budget layers of ``rule``: one that ranks its member rule's own state
    (``reads_rule_state``, e.g. ``kvzip``'s reconstruction scores) needs the rule of its name."""
    try:
        cls = solver.registry.allocator(allocator)
    except RegistryError as exc:
        raise SolverError(f"solver '{solver.name}': parameter 'allocator': {exc}") from None
    if getattr(cls, "reads_rule_state", False) and rule != allocator:
        raise SolverError(f"solver '{solver.name}': allocator '{allocator}' ranks the state of rule '{allocator}' on its "
                          f"layers, so its group's rule must be '{allocator}', not '{rule}' (parameter 'rule'); leave "
                          "rule unset or choose an allocator with a state of its own")


def group_columns(profile: Profile, cols, rule: str) -> list[int]:
    """Columns of ``cols`` that may join a group of ``rule``: its prefill configs that evict."""
    return [int(c) for c in cols if profile.configs[c].rule == rule and profile.configs[c].phase == "prefill"
            and not profile.configs[c].keeps_everything]


def signature_columns(profile: Profile, cols, rule: str, sig: Signature, members) -> np.ndarray:
    """``cols`` with the group rule's configs at ``sig`` only (the other rules and keep-1.0 configs all stay)."""
    allowed = {c for c in members if _signature(profile.configs[c]) == sig}
    return np.asarray([c for c in cols if int(c) in allowed or profile.configs[c].rule != rule
                       or profile.configs[c].keeps_everything], np.int64)


def global_columns(solver: Solver, profile: Profile, budget: Budget, table: np.ndarray, cols, rule: str
                   ) -> tuple[list[int], Signature]:
    """The ``global`` plan (``shares = "profile"``) of a profile without a pair table, as one column per layer, and
    the members' signature (what ``refine`` starts from with ``start = "global"``)."""
    members = group_columns(profile, cols, rule)
    best = None
    for sig in sorted({_signature(profile.configs[c]) for c in members}, key=_order):
        try:
            chosen, loss, _ = optimal_columns(solver, profile, budget, table,
                                              signature_columns(profile, cols, rule, sig, members),
                                              "the lightest config per layer")
        except SolverError:
            continue
        if best is None or loss < best[1]:
            best = (chosen, loss, sig)
    if best is None:
        raise SolverError(f"solver '{solver.name}': no plan with rule '{rule}' in an allocation group fits the budget "
                          f"({budget.describe()}); raise the budget")
    return best[0], best[2]


def members_of(profile: Profile, choice, rule: str, sig: Signature) -> list[int]:
    """Layers of ``choice`` (a column per layer) that run the group's rule at the group's signature."""
    return [i for i, c in enumerate(choice) if profile.configs[c].rule == rule and profile.configs[c].phase == "prefill"
            and not profile.configs[c].keeps_everything and _signature(profile.configs[c]) == sig]


def _model_layers(profile: Profile, layers: list[int]) -> list[int]:
    """``layers`` of ``profile`` numbered in its whole model (a profile cut to its unbounded layers numbers them
    from 0; :func:`polykv.solvers.windowed.whole_model`)."""
    whole = whole_model(profile.model)
    if whole is None:
        return layers
    bounds = window_bounds(whole)
    free = [i for i in range(whole.num_layers) if i not in bounds]
    return [free[i] for i in layers]


def _joins(entry, rule: str) -> bool:
    op = entry["prefill"] if isinstance(entry, dict) else entry.prefill
    return not op.keeps_everything and op.rule == rule


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)
