"""The hooks a polykv plugin implements. Each receives a host-supplied ``register`` callable."""

import pluggy

PROJECT = "polykv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_rules(register):
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


class Deprecated:
    """Hooks of 0.1 still called for third-party plugins (the registry warns, DeprecationWarning, when one is
    implemented); not part of the contract."""

    @staticmethod
    @hookspec
    def register_operators(register):
        """The 0.1 name of :func:`register_rules`."""
