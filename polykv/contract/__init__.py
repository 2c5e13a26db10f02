"""The plugin contract: everything a retention rule, quantizer or allocator plugin imports.

A plugin imports from this package only (``from polykv.contract import ScoredRule, param, hookimpl``), and
:mod:`polykv.errors`. A minimal rule is a :class:`ScoredRule` with a ``name``, its parameters as typed fields
(:func:`param`) and a ``score`` method, registered by a :data:`hookimpl` ``register_rules``. The front door:

- rules: :class:`RetentionRule`, :class:`ScoredRule`, the :class:`SelectionContext` they decide in, what they
  return (:class:`Selection`, or indices from :func:`top_k_sorted`, :func:`ragged_top_k`, :func:`newest_tokens`),
  what they remember (:class:`RuleState`), the phases (:data:`PHASES`);
- quantizers and their stores: :class:`Quantizer`, :class:`KVStore`;
- allocators: :class:`Allocator`;
- parameters: :func:`param`, :class:`ParamError`; per-model data: :class:`ModelDataNeed`;
- registration: :data:`hookimpl`; a rule wrapping another finds it with :func:`registered_rule`.

The building blocks that only some plugins need are the contract's modules, imported through this package
(``from polykv.contract import state``): :mod:`~polykv.contract.state` (the built-in rule states),
:mod:`~polykv.contract.selection` (merges), :mod:`~polykv.contract.probe` (a model pass after prefill),
:mod:`~polykv.contract.allocators` (what an allocator is asked), :mod:`~polykv.contract.schedules` (PyramidKV's
staircase), :mod:`~polykv.contract.model_data` (side files, the model's tokenizer) and
:mod:`~polykv.contract.storage` (the token buffer a store fills, the 16-bit store, shape checks).

Names of 0.1 that left the front door still import from here, with a DeprecationWarning naming the module
they live in. Modules inside polykv import the submodules, never this package.
"""

import importlib
import warnings

from polykv.contract import allocators, model_data, probe, schedules, selection, state, storage
from polykv.contract.allocators import Allocator
from polykv.contract.hookspecs import hookimpl
from polykv.contract.model_data import ModelDataNeed
from polykv.contract.params import ParamError, param
from polykv.contract.rules import PHASES, RetentionRule, ScoredRule, SelectionContext, registered_rule
from polykv.contract.selection import Selection, newest_tokens, ragged_top_k, top_k_sorted
from polykv.contract.state import RuleState
from polykv.contract.stores import KVStore, Quantizer

__all__ = [
    # rules: what they are, where they decide, what they return and remember
    "RetentionRule", "ScoredRule", "SelectionContext", "Selection", "RuleState", "PHASES",
    "top_k_sorted", "ragged_top_k", "newest_tokens", "registered_rule",
    # quantizers, allocators, parameters, per-model data, registration
    "Quantizer", "KVStore", "Allocator", "param", "ParamError", "ModelDataNeed", "hookimpl",
    # building blocks some plugins need
    "state", "selection", "probe", "allocators", "schedules", "model_data", "storage",
]

_MOVED = {
    **dict.fromkeys(("SIGNALS", "SIGNAL_NONE", "SIGNAL_LAST_QUERY", "SIGNAL_WINDOW", "SIGNAL_ACCUMULATED",
                     "SIGNAL_PREROPE_STATS", "window_rows", "Register"), "polykv.contract.rules"),
    **dict.fromkeys(("Merge", "as_selection", "STREAMS"), "polykv.contract.selection"),
    **dict.fromkeys(("QueryWindow", "AccumulatedAttention", "Observation", "CompositeState", "state_bytes", "NEEDS",
                     "COLUMN_SUMS", "COLUMN_SUMS_PER_HEAD", "LAST_ROWS", "attention_probabilities"),
                    "polykv.contract.state"),
    **dict.fromkeys(("ProbeChunk", "probe_tokens"), "polykv.contract.probe"),
    "WriteCost": "polykv.contract.stores",
    "AllocationRequest": "polykv.contract.allocators",
    **dict.fromkeys(("pyramid_capacities", "trim_to"), "polykv.contract.schedules"),
    **dict.fromkeys(("ParamSpec", "check_params", "DeclaredParams", "NO_DEFAULT", "with_defaults", "resolve_params",
                     "unchecked_params", "UncheckedParamsWarning"), "polykv.contract.params"),
    **dict.fromkeys(("need_of", "side_file", "tokenizer_of"), "polykv.contract.model_data"),
    "PROJECT": "polykv.contract.hookspecs",
    "get_registry": "polykv.registry",
}
"""Names polykv.contract exported in 0.1 -> the module that holds them now."""
_RULE_DATA = ("QueryStats", "compute_query_stats", "QUERY_STATS_SUFFIX", "HeadScores", "HEAD_SCORES_SUFFIX")
"""Names polykv.contract exported in 0.1 that a rule's data module holds now (found through the rules' declared
model-data needs, so that the contract names no plugin)."""


def _rule_data_module(name: str) -> str | None:
    """The module of a registered rule's data (the module of its need's ``load``) that defines ``name``, or None."""
    from polykv.registry import get_registry   # the registry imports the contract's hook specs: looked up on use

    for need in model_data.registered_needs(get_registry()):
        module = getattr(need.load, "__module__", None)
        if module and hasattr(importlib.import_module(module), name):
            return module
    return None


def __getattr__(name: str):
    module = _MOVED.get(name) or (_rule_data_module(name) if name in _RULE_DATA else None)
    if module is None:
        raise AttributeError(f"module 'polykv.contract' has no attribute {name!r}")
    warnings.warn(f"polykv.contract.{name} left the plugin contract's front door in 0.2; import it from {module} "
                  f"(it goes from polykv.contract in 0.3)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
