"""polykv: compose KV-cache compression per transformer layer and per phase.

Data flows one way: profile -> solver -> plan -> runtime -> study.
"""

__version__ = "0.1.0"

from polykv.contract.hookspecs import hookimpl  # noqa: E402
from polykv.plan import (FULL_OP, LayerPlan, ModelInfo, OpSpec, Plan, Provenance, TriggerSettings,  # noqa: E402
                         full_plan, load_plan, per_layer_plan, uniform_plan, validate_plan)
from polykv.registry import declare_builtin_plugins, get_registry  # noqa: E402

BUILTIN_PLUGINS = (
    "polykv.adapters.rules",
    "polykv.adapters.quantizers",
    "polykv.solvers.builtin",
    "polykv.studies.builtin_tasks",
)
"""The modules whose hooks register the built-in rules, quantizers, allocators, solvers and tasks. They
register through the same hooks a third-party plugin implements; declared here, at the top of the
package, so the registry (a bottom module) names no higher layer."""
declare_builtin_plugins(BUILTIN_PLUGINS, version=__version__)


def __getattr__(name: str):
    """``apply`` (run a plan on a model inside a ``with`` block) and ``answer`` (compress a context once and answer
    questions from it) are the runtime's own :func:`polykv.runtime.session.apply` and
    :func:`polykv.runtime.answer.answer`: imported on first use (the runtime loads torch and transformers), then
    bound here, so later calls go straight to them."""
    if name == "apply":
        from polykv.runtime.session import apply as value
    elif name == "answer":
        from polykv.runtime.answer import answer as value
    else:
        raise AttributeError(f"module 'polykv' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"apply", "answer"})


__all__ = ["__version__", "hookimpl", "get_registry", "load_plan", "validate_plan", "Plan", "LayerPlan", "OpSpec", "ModelInfo",
           "Provenance", "TriggerSettings", "FULL_OP", "uniform_plan", "full_plan", "per_layer_plan", "apply",
           "answer"]
