"""What every solver shares: parameters, config -> layer entry, costs on the budget's basis, provenance.

A solver is a plugin class with ``name``, ``defaults`` and ``solve(profile, budget, **params)``
returning a :class:`polykv.Plan`. It sees a :class:`~polykv.profiling.profile.Profile` and a
:class:`~polykv.profiling.budget.Budget`, never a model. :meth:`Solver.plan` counts the finished
plan's bytes on the budget's basis itself (not trusting the solver's own count), refuses a plan over
the budget, writes capacities as ratios of the context (or as tokens when ``capacities="tokens"``),
and records the basis, batch and cache dtype in the provenance.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import attrs
import numpy as np

from polykv.errors import PlanError, RegistryError, SolverError
from polykv.registry import get_registry
from polykv.contract.params import ParamError, ParamSpec, check_params
from polykv.plan import AllocationGroup, FULL_OP, FULL_RULE, LayerPlan, OpSpec, Plan, Provenance, per_layer_plan
from polykv.plan.groups import check_group_bounds, check_groups
from polykv.plan.io import check_group_allocators
from polykv.profiling.budget import Budget, bits_to_bytes, layer_bits

METRIC_SPEC = ParamSpec(str, nullable=True, description="a metric table of the profile (null: the profile's routing "
                        "metric; a profile that records none: l2, else the first)")
RULE_SPEC = ParamSpec(str, nullable=True, description="a profiled rule (null: the profile's only rule)")
CAPACITY_FORMS = ("ratio", "tokens")
"""How plans write capacities: ``ratio`` of the context (keeps its compression at any length) or ``tokens``."""
from polykv.profiling.profile import CandidateConfig, Profile, now_iso


class Solver:
    """Base class of plan solvers.

    Subclasses set ``name``, ``defaults`` (every parameter with its default) and implement
    :meth:`solve`. ``registry`` (default: the process-wide one) tells which phases a rule runs in.
    """

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, Any]] = {}
    param_specs: ClassVar[Mapping[str, ParamSpec]] = {}
    """Type and range of each parameter (checked by :meth:`params`; one without a spec is taken as given)."""
    rule_lists: ClassVar[tuple[str, ...]] = ()
    """Parameters that hold a list of rule names (or null): non-empty, distinct, every entry a name."""
    paper: ClassVar[str] = ""
    routes_axes: ClassVar[bool] = False
    """True for a solver that routes the low-rank and layer-pair axes a profile may hold; the others see the
    profile's full-rank configs only (:meth:`~polykv.profiling.profile.Profile.without_axes`)."""
    needs_model: ClassVar[bool] = False
    """True for a solver that measures its plans on the model (``refine``): :func:`polykv.solvers.solve`
    then requires ``model=`` and sets :attr:`measure_on`."""

    def __init__(self, registry=None, capacities: str = "ratio"):
        if capacities not in CAPACITY_FORMS:
            raise SolverError(f"capacities must be one of {CAPACITY_FORMS}, got {capacities!r}")
        self._registry = registry
        self.capacity_form = capacities
        self.measure_on = None
        """What a measuring solver runs plans on (:class:`polykv.solvers.refine.MeasureOn`), else None."""

    @property
    def registry(self):
        if self._registry is None:
            self._registry = get_registry()
        return self._registry

    def solve(self, profile: Profile, budget: Budget, **params: Any) -> Plan:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------
    def params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``defaults`` updated with ``given``; an unknown name is an error listing the known ones."""
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise SolverError(f"solver '{self.name}' has no parameter(s) {unknown}; "
                              f"known: {sorted(self.defaults) or '(none)'}")
        try:
            check_params(self.param_specs, given)
        except ParamError as exc:
            raise SolverError(f"solver '{self.name}': {exc}") from None
        for name in self.rule_lists:
            _check_rule_list(self.name, name, given.get(name))
        return {**self.defaults, **given}

    def check_phase(self, rule: str, phase: str, where: str) -> None:
        """Raise unless ``rule`` is registered and runs in ``phase`` (both phases for ``"both"``)."""
        if rule == FULL_RULE:
            return
        try:
            cls = self.registry.rule(rule)
        except RegistryError as exc:
            raise SolverError(f"{where}: {exc}") from None
        needed = {"prefill", "decode"} if phase == "both" else {phase}
        missing = needed - set(cls.phases)
        if missing:
            raise SolverError(f"{where}: rule '{rule}' is configured for phase '{phase}' but does not run in "
                              f"{sorted(missing)} (it supports {sorted(cls.phases)}); fix the config's phase "
                              "in the profile or leave the config out")

    def check_configs(self, profile: Profile, columns) -> None:
        """Raise unless every config in ``columns`` names a registered rule that runs in its phase (the
        error names the profile file and the config), before any solving."""
        checked = set()
        for i in columns:
            c = profile.configs[int(i)]
            if not c.keeps_everything and (c.rule, c.phase) not in checked:
                self.check_phase(c.rule, c.phase, f"{profile.source}: configs[{int(i)}] ({c.label})")
                checked.add((c.rule, c.phase))

    def layer_entry(self, config: CandidateConfig, where: str = "", *, profile: Profile | None = None
                    ) -> dict[str, Any]:
        """Plan fields for one layer running ``config``: the phase decides which op gets the rule; the
        widths are stored with ``profile``'s quantizer (the one ``config`` was measured with)."""
        bits = {"k_bits": config.k_bits, "v_bits": config.v_bits, **(profile.quantizer_fields() if profile else {}),
                **{name: getattr(config, name) for name in ("k_rank", "v_rank") if getattr(config, name) is not None}}
        if config.keeps_everything:
            return {"prefill": FULL_OP, "decode": FULL_OP, **bits}
        self.check_phase(config.rule, config.phase, where or f"config {config.label}")
        op = OpSpec(rule=config.rule, capacity_ratio=float(config.keep), params=config.params)
        return {"prefill": op if config.phase in ("prefill", "both") else FULL_OP,
                "decode": op if config.phase in ("decode", "both") else FULL_OP, **bits}

    def plan(self, profile: Profile, budget: Budget, layers: Sequence[Mapping[str, Any]], params: Mapping[str, Any],
             *, predicted_loss: float | None, predicted_bits: int, note: str = "",
             allocation: Sequence[AllocationGroup] = ()) -> Plan:
        """A plan with full provenance; refuses to return one over the budget.

        The bytes recorded are counted here from the finished layers on the budget's basis (an allocation
        group's layers at their planned capacities, whose sum is the group's total);
        ``predicted_bits`` (the solver's own count) must not exceed the budget either. ``allocation`` groups
        are checked as plan validation checks them (members, allocator, its bound at the budget's context).
        """
        limit = budget.to_bits(profile.model)
        entries = [LayerPlan(layer=i, **dict(e)) if not isinstance(e, LayerPlan) else e for i, e in enumerate(layers)]
        entries = [self._capacity_form(self._profile_quantizer(lp, profile), budget.context_tokens) for lp in entries]
        used = budget.plan_bits(profile.model, entries, self.registry)
        if max(used, predicted_bits) > limit:
            raise SolverError(f"solver '{self.name}' produced {bits_to_bytes(max(used, predicted_bits))} bytes, over "
                              f"the budget of {limit // 8} bytes ({budget.describe()}); raise the budget")
        from polykv import __version__

        prov = Provenance(solver=self.name, params=_jsonable(params), budget=budget.as_dict(),
                          context_tokens=budget.context_tokens,
                          predicted_loss=None if predicted_loss is None else float(predicted_loss),
                          predicted_bytes=bits_to_bytes(used), profile_fingerprint=profile.fingerprint,
                          polykv_version=__version__, created=now_iso(), note=note, basis=budget.basis,
                          batch=budget.batch if budget.resident else None,
                          cache_dtype=budget.cache_dtype if budget.resident else None)
        plan = per_layer_plan(profile.model, entries, provenance=prov)
        if allocation:
            plan = attrs.evolve(plan, allocation=tuple(allocation))
            try:
                check_groups(plan, source=f"solver '{self.name}'")
                check_group_allocators(plan, self.registry, source=f"solver '{self.name}'")
                check_group_bounds(plan, self.registry, budget.context_tokens, source=f"solver '{self.name}'")
            except PlanError as exc:
                raise SolverError(f"solver '{self.name}' built an allocation group the runtime would refuse: {exc}; "
                                  "choose the group's rule and allocator so that they go together") from None
        return plan

    def _profile_quantizer(self, lp: LayerPlan, profile: Profile) -> LayerPlan:
        """``lp`` storing its widths with the profile's quantizer; a quantized layer naming another is refused
        (the profile's losses and byte costs describe its own quantizer only)."""
        fields = profile.quantizer_fields()
        if not lp.quantized:
            return attrs.evolve(lp, **fields)
        if (lp.quantizer, dict(lp.quantizer_params)) != (fields["quantizer"], fields["quantizer_params"]):
            raise SolverError(f"solver '{self.name}': layer {lp.layer} stores K{lp.k_bits}/V{lp.v_bits} with quantizer "
                              f"{_describe_quantizer(lp.quantizer, lp.quantizer_params)} but {profile.source} was "
                              f"calibrated with {_describe_quantizer(profile.quantizer, profile.quantizer_params)}; "
                              "solve with the profile's quantizer or calibrate a profile with this one")
        return lp

    def _capacity_form(self, lp: LayerPlan, context_tokens: int) -> LayerPlan:
        """``lp`` with every rule op's capacity written as a ratio of ``context_tokens`` (or as tokens)."""
        ops = {}
        for phase in ("prefill", "decode"):
            op = getattr(lp, phase)
            if not op.keeps_everything and (op.capacity is not None or self.capacity_form == "tokens"):
                tokens = op.resolve_capacity(context_tokens)
                if self.capacity_form == "tokens":
                    op = attrs.evolve(op, capacity=tokens, capacity_ratio=None)
                else:
                    op = attrs.evolve(op, capacity=None, capacity_ratio=min(1.0, tokens / context_tokens))
            ops[phase] = op
        return attrs.evolve(lp, **ops)

    def config_layer(self, config: CandidateConfig, where: str = "", *, profile: Profile | None = None) -> LayerPlan:
        """:meth:`layer_entry` as a :class:`polykv.LayerPlan` (layer 0), for counting its bytes."""
        return LayerPlan(layer=0, **self.layer_entry(config, where, profile=profile))


def _describe_quantizer(name: str, params) -> str:
    return f"'{name}'" + (f" {dict(sorted(dict(params).items()))}" if params else "")


def _check_rule_list(solver: str, name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(r, str) and r for r in value):
        raise SolverError(f"solver '{solver}': parameter '{name}' must be a non-empty list of rule names such as "
                          f"[\"snapkv\", \"tova\"] (or null for every profiled rule), got {value!r}")
    twice = sorted({r for r in value if list(value).count(r) > 1})
    if twice:
        raise SolverError(f"solver '{solver}': parameter '{name}' lists {twice} more than once; list each rule once")


def config_bits(profile: Profile, budget: Budget | int, solver: "Solver | None" = None) -> np.ndarray:
    """[C] int64 bits one layer takes under each config at the budget's context, on the budget's basis
    (resident: :meth:`~polykv.profiling.budget.Budget.layer_bits_bound`, robust to slightly shorter contexts).

    A context length in place of a budget gives the nominal bits at that length.
    """
    if isinstance(budget, int):
        budget = Budget(kind="ratio", value=1.0, context_tokens=budget, basis="nominal")
    T = budget.context_tokens
    if not budget.resident:
        return np.array([layer_bits(profile.model, c.keep, c.k_bits, c.v_bits, T) for c in profile.configs],
                        dtype=np.int64)
    solver = solver if solver is not None else Solver()
    return np.array([budget.layer_bits_bound(profile.model, solver.config_layer(c, f"config {c.label}",
                                                                                 profile=profile),
                                             solver.registry) for c in profile.configs], dtype=np.int64)


def min_bytes_message(solver: str, need_bits: int, budget: Budget, what: str) -> str:
    return (f"solver '{solver}': the cheapest plan ({what}) needs {bits_to_bytes(need_bits)} {budget.basis} bytes "
            f"at T={budget.context_tokens}, over the budget ({budget.describe()}); the minimum feasible budget is "
            f"{bits_to_bytes(need_bits)} bytes")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
