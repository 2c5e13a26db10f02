"""``refine``: the exact plan, improved by moves measured end to end on held-out sequences.

``exact`` is optimal for the profile's additive loss model, which a long context can contradict (a
profile measured one layer at a time at 512 tokens does not add up to what the plan does at 2,048).
``refine`` starts from the exact plan at the same budget and measures whole plans through the
runtime (:class:`polykv.profiling.plan_meter.PlanMeter`: next-token KL against the full cache on
held-out corpus sequences, the prefill reused). Each step it tries moves in the profile's order and
takes the first whose measured KL is lower than the current plan's:

- one layer to a *neighbour* config of the menu (the next keep, K width or V width of the same rule,
  the keep-1.0 config at the same widths above a rule's largest keep, or another rule at the same
  keep and widths), when the plan still fits the budget;
- a *swap*: one layer up to a neighbour costing more bytes, another down to one costing fewer, the
  plan within the budget.

Moves are ordered by the profile's predicted gain per byte moved (−Δloss / bits the move adds to
the upgraded layer; a move adding none counts one bit), best first; only ``tries`` are measured per
step. The search stops after ``steps`` accepted moves, or when no tried move lowers the measured
KL. The plan therefore never ends with a higher measured KL than the exact plan on these sequences,
and never over the budget (bytes counted like ``exact``'s, the plan recounted by the base class).

This solver sees a model: :func:`polykv.solvers.solve` passes it as ``model=`` (a
:class:`MeasureOn`), ``polykv solve --model``. The provenance's ``measured`` field records every
measured move and the final measured KL of ``exact`` and ``refine``. Deterministic for a seed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import attrs

from polykv.contract.params import ParamSpec
from polykv.errors import ProfileError, SolverError, StudyError
from polykv.models.corpus import corpus_documents
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup
from polykv.profiling.budget import Budget, bits_to_bytes
from polykv.profiling.objectives import METRIC_OF, build as build_followups, parse_objectives
from polykv.profiling.meter_pool import MeterPool
from polykv.profiling.plan_meter import PlanMeter, calibration_draw, heldout_sequences
from polykv.profiling.profile import Profile, check_measured_on
from polykv.profiling.profile_checks import MIX_METRIC
from polykv.solvers.base import METRIC_SPEC, Solver, config_bits
from polykv.solvers.exact import candidate_columns, optimal_columns
from polykv.solvers.global_budget import check_pairing, global_columns, members_of
from polykv.solvers.refine_moves import apply_move, menu_neighbours, ranked_moves
from polykv.solvers.windowed import whole_model, whole_model_plan


@attrs.define(frozen=True, kw_only=True)
class MeasureOn:
    """The model a measuring solver runs its candidate plans on."""

    model: Any
    """A transformers decoder the runtime serves, on the profile's model."""
    tokenizer: Any
    """Its tokenizer (the held-out corpus sequences are tokenized with it, no special tokens)."""
    model_data: Mapping[str, Any] = attrs.field(factory=dict)
    """Per-model data the plans' rules read (e.g. the profile's query statistics), as :func:`polykv.apply`."""
    storage_dtype: Any = None
    """torch dtype the cache stores K/V in; None: the resident budget's ``cache_dtype`` (compute dtype for a
    nominal budget)."""
    name: str = ""
    """What the model is, for the provenance (e.g. ``default``)."""
    progress: Any = None
    """Called with one line of text after each measured plan (``polykv solve`` prints it to stderr), or None."""
    ray: "OnRay | None" = None
    """Measure each step's candidate plans on Ray workers (:class:`OnRay`); None: here, one after the other."""


@attrs.define(frozen=True, kw_only=True)
class OnRay:
    """Where ``refine`` measures its candidates on Ray (:class:`polykv.profiling.meter_pool.MeterPool`)."""

    loader: Callable[[], tuple]
    """Picklable (a module-level function or a ``functools.partial`` of one): ``(model, tokenizer)`` on a worker,
    the model :attr:`MeasureOn.model` is."""
    address: str | None = None
    """None: the Ray initialised in this process; ``"local"`` starts one; ``"auto"`` / ``"host:port"`` joins one."""
    workers: int | None = None
    """Workers (None: the cluster's CPUs / ``cpus_per_worker``)."""
    cpus_per_worker: float = 1
    threads: int | None = None
    """torch threads per worker (None: ``cpus_per_worker``); the serial run's count gives the serial bits."""


STARTS = ("exact", "global")


def _count(minimum: int, what: str) -> ParamSpec:
    return ParamSpec(int, low=minimum, description=what)


class Refine(Solver):
    """The exact plan improved by end-to-end measured moves (module docstring)."""

    name = "refine"
    needs_model = True
    defaults = {"metric": None, "rules": None, "steps": 8, "tries": 6, "sequences": 4, "tokens": None,
                "follow_up": None, "seed": 0, "corpus": "mixed", "validate": 0, "objectives": None, "start": "exact",
                "allocator": None}
    param_specs = {"metric": METRIC_SPEC,
                   "start": ParamSpec(str, choices=STARTS, description="the plan the search starts from"),
                   "allocator": ParamSpec(str, nullable=True, description="the allocation group's allocator (start "
                                          "global)"),
                   "steps": _count(0, "moves accepted at most"),
                   "tries": _count(1, "moves measured per step at most"),
                   "sequences": _count(1, "held-out sequences measured"),
                   "tokens": ParamSpec(int, nullable=True, low=1,
                                       description="context tokens each sequence compresses (null: the profile's)"),
                   "follow_up": ParamSpec(int, nullable=True, low=2,
                                          description="follow-up tokens after the context (null: the profile's)"),
                   "seed": ParamSpec(int, low=0, description="seed of the held-out corpus draw"),
                   "corpus": ParamSpec(str, choices=("mixed", "prose", "code"),
                                       description="corpus kind"),
                   "validate": _count(0, "further held-out sequences the exact and final plans are measured on")}
    rule_lists = ("rules",)
    paper = "exact multiple-choice knapsack, refined by end-to-end KL on held-out sequences"

    def solve(self, profile: Profile, budget: Budget, **params: Any):
        p = self.params(params)
        on = self.measure_on
        if on is None:
            raise SolverError("solver 'refine' measures its candidate plans on the model: pass it with "
                              "polykv solve --model default (or a model folder), or solve(..., model=MeasureOn(...))")
        start = time.perf_counter()
        table = profile.table(p["metric"])
        cols = candidate_columns(self, profile, p["rules"])
        whole = whole_model(profile.model)  # solve_around_windows handed over the unbounded layers only
        group = None
        if p["start"] == "global":
            self._check_global(profile, p)
            choice, sig = global_columns(self, profile, budget, table, cols, p["allocator"])
            group = (p["allocator"], sig)
        weights = self._objectives(profile, p)
        meter, check, desc, tokens, follow, meter_args = self._meter(profile, budget, p, on, cols, whole, weights)
        if group is None:
            choice, _, _ = optimal_columns(self, profile, budget, table, cols, "the lightest config per layer")
        pool = None if on.ray is None else MeterPool(on.ray.loader, meter_args, address=on.ray.address,
                                                     workers=on.ray.workers, cpus_per_worker=on.ray.cpus_per_worker,
                                                     threads=on.ray.threads)
        try:
            return self._search(profile, budget, p, on, table, cols, whole, group, choice, weights, meter, check,
                                desc, tokens, follow, pool, start)
        finally:
            if pool is not None:
                pool.close()

    def _search(self, profile, budget, p, on, table, cols, whole, group, choice, weights, meter, check, desc, tokens,
                follow, pool, start):
        """The search of :meth:`solve` (module docstring); with a ``pool`` each step's tried moves are measured on
        Ray workers at once, then taken in the serial order, so the plan and the record are the serial run's."""
        bits = config_bits(profile, budget, self)
        cap = budget.to_bits(profile.model)
        neighbours = menu_neighbours(profile.configs)
        allowed = {int(c) for c in cols}

        def plan_of(ch):
            layers = [self.layer_entry(profile.configs[c], f"layer {i}", profile=profile) for i, c in enumerate(ch)]
            joined = [] if group is None else members_of(profile, ch, group[0], group[1])
            return self.plan(profile, budget, layers, p, predicted_loss=float(sum(table[i, c] for i, c in
                                                                                enumerate(ch))),
                             predicted_bits=int(sum(int(bits[c]) for c in ch)),
                             allocation=(AllocationGroup(allocator=group[0], layers=tuple(joined)),) if joined else ())

        def runnable(plan):  # the plan of every layer of the model: window-bounded layers keep their window
            return plan if whole is None else whole_model_plan(whole, plan)

        measured: dict[tuple, float] = {}
        ahead: dict[tuple, float] = {}  # measured on Ray, not yet reached by the serial order

        def kl(ch) -> float:
            key = tuple(ch)
            if key not in measured:
                measured[key] = ahead.pop(key) if key in ahead else meter.measure(runnable(plan_of(ch)))
                if on.progress is not None:
                    on.progress(f"refine: plan {len(measured)} measured, KL {measured[key]:.6g} nats "
                                f"({meter.prefills} prefills, {time.perf_counter() - start:.0f} s)")
            return measured[key]

        exact_kl = current = kl(choice)
        exact_choice = list(choice)
        steps, stopped, accepted = [], "step limit reached", 0
        while True:
            if accepted >= p["steps"]:
                break
            moves = [m for m in ranked_moves(table, bits, choice, cap, neighbours, allowed)
                     if tuple(apply_move(choice, m)) not in measured][:p["tries"]]
            if not moves:
                stopped = "no untried move fits the budget"
                break
            took = False
            if pool is not None:
                todo = [apply_move(choice, m) for m in moves if tuple(apply_move(choice, m)) not in ahead]
                ahead.update(zip((tuple(c) for c in todo), pool.measure([runnable(plan_of(c)) for c in todo])))
            for move in moves:
                cand = apply_move(choice, move)
                value = kl(cand)
                ok = value < current
                steps.append({"step": accepted + 1, "move": [{"layer": l, "from": profile.configs[choice[l]].label,
                                                             "to": profile.configs[c].label} for l, c in move],
                              "predicted_loss": float(sum(table[i, c] for i, c in enumerate(cand))),
                              "predicted_bytes": bits_to_bytes(int(sum(int(bits[c]) for c in cand))),
                              "measured_kl": value, "accepted": ok})
                if ok:
                    choice, current, took = cand, value, True
                    accepted += 1
                    break
            if not took:
                stopped = f"none of the {len(moves)} moves tried lowered the measured KL"
                break
        plan = plan_of(choice)
        validation = None
        if check is not None:  # sequences the search never saw: does the measured gain carry over?
            validation = {"sequences": p["validate"], f"{'exact' if p['start'] == 'exact' else 'start'}_kl":
                          check.measure(runnable(plan_of(exact_choice))), "refine_kl": check.measure(runnable(plan))}
        mixed = weights is not None
        record = {"metric": _metric_name(weights), "model": on.name, "sequences": p["sequences"],
                  "context_tokens": tokens, "follow_up": follow, "corpus": desc,
                  "storage_dtype": _dtype_name(meter.storage_dtype), "start": p["start"],
                  **({"objectives": {METRIC_OF[o]: w for o, w in weights.items()}, "items": len(meter.sequences)}
                     if mixed else {}),
                  **({"exact_kl": exact_kl} if p["start"] == "exact" else {"start_kl": exact_kl}),
                  "refine_kl": current, "accepted": accepted, "measured": len(steps) + 1,
                  "prefills": meter.prefills + (sum(pool.prefills.values()) if pool is not None else 0),
                  **({"ray_measured": len(measured) + len(ahead) - 1} if pool is not None else {}),
                  "stopped": stopped, "seconds": round(time.perf_counter() - start, 3),
                  "validation": validation, "steps": steps}
        what = "KL" if not mixed else f"{record['metric']} KL"
        note = (f"the {p['start']} plan refined by {accepted} measured move(s): held-out {what} {exact_kl:.6g} "
                f"({p['start']}) -> {current:.6g} nats over {p['sequences']} sequences"
                + (f" ({len(meter.sequences)} follow-ups)" if mixed else "") + f"; {stopped}"
                + (f"; on {validation['sequences']} further sequences "
                   f"{validation.get('exact_kl', validation.get('start_kl')):.6g} -> {validation['refine_kl']:.6g}"
                   if validation else ""))
        return attrs.evolve(plan, provenance=attrs.evolve(plan.provenance, note=note, measured=record))

    def held_out(self, profile: Profile, p: Mapping[str, Any], max_positions: int | None = None) -> tuple[int, int]:
        """(context, follow-up) tokens of each held-out sequence: ``tokens`` (else the profile's calibration
        context) and ``follow_up`` (else what the calibration draw had after it, else 128). Refused, naming the
        options, when the sequences pass ``max_positions`` (the model's max_position_embeddings) or when the offline
        corpus holds too few texts long enough for ``sequences + validate`` of them."""
        if p["start"] == "global":  # refused here, before the model loads
            self._check_global(profile, p)
        self._objectives(profile, p)
        draw, prov = calibration_draw(profile), profile.provenance
        tokens = p["tokens"] if p["tokens"] is not None else prov.context_tokens
        if tokens is None:
            raise SolverError(f"solver 'refine': {profile.source} records no calibration context length; give the "
                              "context the held-out sequences compress (polykv solve --tokens N, or tokens=N)")
        follow = p["follow_up"]
        if follow is None:
            known = draw is not None and prov.context_tokens is not None and draw.tokens > prov.context_tokens
            follow = draw.tokens - prov.context_tokens if known else 128
        if max_positions is not None and tokens + follow > int(max_positions):
            given = "the profile's calibration context" if p["tokens"] is None else \
                f"--tokens / --param tokens={tokens}"
            after = "--param follow_up, by default" if p["follow_up"] is None else f"--param follow_up={follow}"
            raise SolverError(f"solver 'refine': each held-out sequence is {tokens} context tokens ({given}) + "
                              f"{follow} follow-up tokens ({after}) = {tokens + follow} positions, more than "
                              f"the model's {int(max_positions)} (max_position_embeddings); lower --tokens or "
                              f"--param follow_up")
        try:
            corpus_documents(p["corpus"], p["sequences"] + p["validate"], min_chars=4 * (tokens + follow),
                             seed=p["seed"])
        except StudyError:
            raise _too_few(p, tokens + follow) from None
        return tokens, follow

    def _check_global(self, profile: Profile, p: Mapping[str, Any]) -> None:
        """``start = "global"``: a registered allocator whose rule the profile measured, and no pair table."""
        if p["allocator"] is None:
            raise SolverError("solver 'refine': start 'global' needs the group's allocator: --param allocator=NAME")
        check_pairing(self, p["allocator"], p["allocator"])
        if not any(c.rule == p["allocator"] and not c.keeps_everything for c in profile.configs):
            raise SolverError(f"solver 'refine': start 'global' groups the layers of rule '{p['allocator']}' (the rule "
                              f"of allocator '{p['allocator']}'), which {profile.source} has no configs of; calibrate "
                              "it or start from exact")

    def _objectives(self, profile: Profile, p: Mapping[str, Any]) -> dict[str, float] | None:
        """``{objective: weight}`` the search measures, or None for continuation alone (the plain held-out KL):
        ``objectives`` (default: the profile's objective mix), weighted as the profile weighs them (1 otherwise)."""
        by_metric = {m: o for o, m in METRIC_OF.items()}
        weights = {by_metric[m]: float(w) for m, w in (profile.objective_weights or {}).items() if m in by_metric}
        given = p["objectives"]
        if isinstance(given, str):
            given = [x for x in given.split(",") if x]
        if given is not None and (not isinstance(given, (list, tuple)) or not given
                                  or not all(isinstance(x, str) for x in given)):
            raise SolverError(f"solver 'refine': parameter 'objectives' must be a non-empty list of objectives such as "
                              f"[\"continuation\", \"retrieval\"] (or null: the profile's mix), got {given!r}")
        names = list(given) if given is not None else list(weights)
        try:
            names, _ = parse_objectives(names) if names else (("continuation",), None)
        except ProfileError as exc:
            raise SolverError(f"solver 'refine': parameter 'objectives': {exc}") from None
        if tuple(names) == ("continuation",):
            return None
        return {o: weights.get(o, 1.0) for o in names}

    def _meter(self, profile: Profile, budget: Budget, p: Mapping[str, Any], on: MeasureOn, cols, whole,
               weights: Mapping[str, float] | None = None):
        import torch

        geometry = geometry_of_model(on.model)
        check_measured_on(profile.model if whole is None else whole, geometry, profile.source)
        tokens, follow = self.held_out(profile, p, geometry.max_positions)
        tokenize = lambda text: on.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        n = p["sequences"]
        try:
            seqs, desc = heldout_sequences(tokenize, n + p["validate"], tokens + follow, seed=p["seed"],
                                           profile=profile, kind=p["corpus"])
        except (ProfileError, StudyError):
            raise _too_few(p, tokens + follow) from None
        dtype = on.storage_dtype
        if dtype is None and budget.resident:
            dtype = getattr(torch, budget.cache_dtype)
        menu = [self.config_layer(profile.configs[int(c)], f"config {profile.configs[int(c)].label}", profile=profile)
                for c in cols]
        args = [self._part_meter(on, part, tokens, dtype, menu, weights, p["seed"]) if part else None
                for part in (seqs[:n], seqs[n:])]
        meters = [PlanMeter(on.model, registry=self.registry, **a) if a is not None else None for a in args]
        return meters[0], meters[1], desc, tokens, follow, args[0]

    def _part_meter(self, on: MeasureOn, seqs, tokens: int, dtype, menu, weights, seed: int) -> dict[str, Any]:
        """The :class:`PlanMeter` arguments (but the model and registry) of the continuation KL of ``seqs``, or of
        the objective mix ``weights`` built on them (every objective's follow-ups, each weighted by its objective's
        weight over its count)."""
        kw = dict(prefix=tokens, model_data=on.model_data, storage_dtype=dtype, layer_menu=menu)
        if weights is None:
            return dict(sequences=list(seqs), **kw)
        try:
            items = build_followups(tuple(weights), seqs, tokens, tokenizer=on.tokenizer, registry=self.registry,
                                    seed=seed)
        except (ProfileError, StudyError) as exc:
            raise SolverError(f"solver 'refine': parameter 'objectives': {exc}") from None
        flat = [(it, weights[name] / len(got)) for name, got in items.items() for it in got]
        return dict(sequences=[it.ids for it, _ in flat], rows=[it.rows for it, _ in flat],
                    weights=[w for _, w in flat], **kw)


def _too_few(p: Mapping[str, Any], length: int) -> SolverError:
    return SolverError(f"solver 'refine': the offline corpus ({p['corpus']}) holds too few texts for "
                       f"{p['sequences'] + p['validate']} held-out sequences of {length} tokens (--param "
                       f"sequences={p['sequences']} + --param validate={p['validate']}); lower them, or --tokens")


def _metric_name(weights: Mapping[str, float] | None) -> str:
    """The table name of what the search measured: ``kl`` (continuation), one objective's, or the mix."""
    if weights is None:
        return "kl"
    return METRIC_OF[next(iter(weights))] if len(weights) == 1 else MIX_METRIC


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")
