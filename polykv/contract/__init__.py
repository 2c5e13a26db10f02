"""The plugin contract: everything a retention rule, quantizer or allocator plugin imports.

A plugin imports from here (``from polykv.contract import ScoredRule, SelectionContext, hookimpl``)
and from the storage building blocks (:mod:`polykv.storage`) if it stores tokens itself; nothing
else of polykv. The modules behind it:

- :mod:`polykv.contract.rules` — retention rules (:class:`RetentionRule`, :class:`ScoredRule`), the
  context a rule decides in (:class:`SelectionContext`), phases and the signals a rule declares;
- :mod:`polykv.contract.selection` — what a rule returns (:class:`Selection`, :class:`Merge`) and
  top-k helpers;
- :mod:`polykv.contract.state` — what a rule remembers between forwards (:class:`RuleState` and the
  built-in states);
- :mod:`polykv.contract.probe` — a model pass after prefill a rule declares (:class:`ProbeChunk`);
- :mod:`polykv.contract.stores` — quantizers and their stores (:class:`Quantizer`, :class:`KVStore`);
- :mod:`polykv.contract.allocators` — run-time budget allocators (:class:`Allocator`);
- :mod:`polykv.contract.params` — parameter declarations (:class:`ParamSpec`);
- :mod:`polykv.contract.model_data` — per-model data files a rule needs (:class:`ModelDataNeed`);
- :mod:`polykv.contract.hookspecs` — the hooks a plugin implements (:data:`hookimpl`);
- :mod:`polykv.contract.score_checks` — the checks a scored rule's scores pass.

Modules inside polykv import the submodules above, never this package: it re-exports from modules
of other packages too (the registry, the query statistics, the PyramidKV schedule), and importing
it from them would wait on itself.
"""

from polykv.contract.allocators import AllocationRequest, Allocator
from polykv.contract.hookspecs import PROJECT, hookimpl
from polykv.contract.model_data import ModelDataNeed, need_of, side_file, tokenizer_of
from polykv.contract.probe import ProbeChunk, probe_tokens, run_probe
from polykv.contract.params import (NO_DEFAULT, DeclaredParams, ParamError, ParamSpec, UncheckedParamsWarning,
                                    check_params, resolve_params, unchecked_params, with_defaults)
from polykv.contract.rules import (PHASES, SIGNAL_ACCUMULATED, SIGNAL_LAST_QUERY, SIGNAL_NONE, SIGNAL_PREROPE_STATS,
                                   SIGNAL_WINDOW, SIGNALS, Register, RetentionRule, ScoredRule, SelectionContext,
                                   window_rows)
from polykv.contract.selection import (STREAMS, Merge, Selection, as_selection, newest_tokens, ragged_top_k,
                                       top_k_sorted)
from polykv.contract.state import (COLUMN_SUMS, COLUMN_SUMS_PER_HEAD, LAST_ROWS, NEEDS, AccumulatedAttention,
                                   CompositeState, Observation, QueryWindow, RuleState, attention_probabilities,
                                   state_bytes)
from polykv.contract.stores import KVStore, Quantizer, WriteCost
from polykv.memory.schedules import pyramid_capacities, trim_to
from polykv.models.kvzip_heads import HEAD_SCORES_SUFFIX, HeadScores
from polykv.models.query_stats import QUERY_STATS_SUFFIX, QueryStats, compute_query_stats
from polykv.registry import get_registry

__all__ = [
    # rules
    "PHASES", "SIGNALS", "SIGNAL_NONE", "SIGNAL_LAST_QUERY", "SIGNAL_WINDOW", "SIGNAL_ACCUMULATED",
    "SIGNAL_PREROPE_STATS", "SelectionContext", "RetentionRule", "ScoredRule", "window_rows", "Register",
    # what a rule returns
    "Selection", "Merge", "as_selection", "top_k_sorted", "ragged_top_k", "newest_tokens", "STREAMS",
    # what a rule remembers
    "RuleState", "QueryWindow", "AccumulatedAttention", "Observation", "CompositeState", "state_bytes",
    "NEEDS", "COLUMN_SUMS", "COLUMN_SUMS_PER_HEAD", "LAST_ROWS", "attention_probabilities",
    # a model pass after prefill
    "ProbeChunk", "probe_tokens", "run_probe",
    # quantizers and stores
    "Quantizer", "KVStore", "WriteCost",
    # allocators and their shared schedule
    "Allocator", "AllocationRequest", "pyramid_capacities", "trim_to",
    # parameters, model data, hooks, the registry
    "ParamSpec", "ParamError", "check_params", "DeclaredParams", "NO_DEFAULT", "with_defaults",
    "resolve_params", "unchecked_params", "UncheckedParamsWarning", "ModelDataNeed", "need_of", "side_file", "tokenizer_of",
    "QueryStats", "compute_query_stats", "QUERY_STATS_SUFFIX", "HeadScores", "HEAD_SCORES_SUFFIX", "PROJECT", "hookimpl", "get_registry",
]
