"""The hooks a polykv plugin implements. Each receives a host-supplied ``register`` callable."""

import pluggy

PROJECT = "polykv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_operators(register):
    """Register retention rules: call ``register(RuleClass)`` once per RetentionRule subclass."""


@hookspec
def register_quantizers(register):
    """Register quantizers: call ``register(QuantizerClass)`` once per Quantizer subclass."""


@hookspec
def register_solvers(register):
    """Register plan solvers: call ``register(SolverClass)`` once per Solver subclass."""


@hookspec
def register_allocators(register):
    """Register budget allocators: call ``register(AllocatorClass)`` once per Allocator subclass
    (:mod:`polykv.contract.allocators`); a plan's allocation group names one."""


@hookspec
def register_tasks(register):
    """Register study tasks: call ``register(TaskClass)`` once per Task subclass."""
