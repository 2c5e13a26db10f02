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


def apply(model, plan, **kwargs):
    """Run ``plan`` on ``model`` inside a ``with`` block; see :func:`polykv.runtime.session.apply`."""
    from polykv.runtime.session import apply as _apply  # the runtime loads torch and transformers: on first use

    return _apply(model, plan, **kwargs)


def answer(model, plan, tokenizer, **kwargs):
    """Compress a context once under ``plan`` and answer questions from it; see :func:`polykv.runtime.answer.answer`."""
    from polykv.runtime.answer import answer as _answer

    return _answer(model, plan, tokenizer, **kwargs)


__all__ = ["__version__", "hookimpl", "get_registry", "load_plan", "validate_plan", "Plan", "LayerPlan", "OpSpec", "ModelInfo",
           "Provenance", "TriggerSettings", "FULL_OP", "uniform_plan", "full_plan", "per_layer_plan", "apply",
           "answer"]
