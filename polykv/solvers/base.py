"""What every solver shares: parameters, config -> layer entry, nominal bytes, and plan provenance.

A solver is a plugin class with ``name``, ``defaults`` and ``solve(profile, budget, **params)``
returning a :class:`polykv.Plan`. It sees a :class:`~polykv.profiling.profile.Profile` and a
:class:`~polykv.profiling.budget.Budget`, never a model.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from polykv.errors import RegistryError, SolverError
from polykv.plan import FULL_OP, FULL_RULE, OpSpec, Plan, Provenance, per_layer_plan
from polykv.profiling.budget import Budget, bits_to_bytes, layer_bits
from polykv.profiling.profile import CandidateConfig, Profile, now_iso


class Solver:
    """Base class of plan solvers.

    Subclasses set ``name``, ``defaults`` (every parameter with its default) and implement
    :meth:`solve`. ``registry`` (default: the process-wide one) tells which phases a rule runs in.
    """

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, Any]] = {}
    paper: ClassVar[str] = ""

    def __init__(self, registry=None):
        self._registry = registry

    @property
    def registry(self):
        if self._registry is None:
            from polykv.registry import get_registry

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
        return {**self.defaults, **given}

    def check_phase(self, rule: str, phase: str, where: str) -> None:
        """Raise unless ``rule`` is registered and runs in ``phase`` (both phases for ``"both"``)."""
        if rule == FULL_RULE:
            return
        try:
            cls = self.registry.operator(rule)
        except RegistryError as exc:
            raise SolverError(f"{where}: {exc}") from None
        needed = {"prefill", "decode"} if phase == "both" else {phase}
        missing = needed - set(cls.phases)
        if missing:
            raise SolverError(f"{where}: rule '{rule}' is configured for phase '{phase}' but does not run in "
                              f"{sorted(missing)} (it supports {sorted(cls.phases)}); fix the config's phase "
                              "in the profile or leave the config out")

    def layer_entry(self, config: CandidateConfig, where: str = "") -> dict[str, Any]:
        """Plan fields for one layer running ``config``: the phase decides which op gets the rule."""
        bits = {"k_bits": config.k_bits, "v_bits": config.v_bits}
        if config.keeps_everything:
            return {"prefill": FULL_OP, "decode": FULL_OP, **bits}
        self.check_phase(config.rule, config.phase, where or f"config {config.label}")
        op = OpSpec(rule=config.rule, capacity_ratio=float(config.keep), params=config.params)
        return {"prefill": op if config.phase in ("prefill", "both") else FULL_OP,
                "decode": op if config.phase in ("decode", "both") else FULL_OP, **bits}

    def plan(self, profile: Profile, budget: Budget, layers: Sequence[Mapping[str, Any]], params: Mapping[str, Any],
             *, predicted_loss: float | None, predicted_bits: int, note: str = "") -> Plan:
        """A plan with full provenance; refuses to return one over the budget."""
        limit = budget.to_bits(profile.model)
        if predicted_bits > limit:
            raise SolverError(f"solver '{self.name}' produced {bits_to_bytes(predicted_bits)} bytes, over the budget "
                              f"of {limit // 8} bytes ({budget.describe()}); raise the budget")
        from polykv import __version__

        prov = Provenance(solver=self.name, params=_jsonable(params), budget=budget.as_dict(),
                          context_tokens=budget.context_tokens,
                          predicted_loss=None if predicted_loss is None else float(predicted_loss),
                          predicted_bytes=bits_to_bytes(predicted_bits), profile_fingerprint=profile.fingerprint,
                          polykv_version=__version__, created=now_iso(), note=note)
        return per_layer_plan(profile.model, list(layers), provenance=prov)


def config_bits(profile: Profile, context_tokens: int) -> np.ndarray:
    """[C] int64 nominal bits one layer takes under each config at ``context_tokens``."""
    return np.array([layer_bits(profile.model, c.keep, c.k_bits, c.v_bits, context_tokens) for c in profile.configs],
                    dtype=np.int64)


def min_bytes_message(solver: str, need_bits: int, budget: Budget, what: str) -> str:
    return (f"solver '{solver}': the cheapest plan ({what}) needs {bits_to_bytes(need_bits)} bytes at "
            f"T={budget.context_tokens}, over the budget ({budget.describe()}); the minimum feasible budget is "
            f"{bits_to_bytes(need_bits)} bytes")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
