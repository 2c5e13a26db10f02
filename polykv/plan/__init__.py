"""Plans: for every layer and phase, which retention rule runs, how much it keeps, and at how many bits.

The modules, each importing only those before it:

- :mod:`polykv.plan.writing` — the JSON text of a plan file (deterministic, atomic saves);
- :mod:`polykv.plan.records` — the attrs records (:class:`Plan`, :class:`LayerPlan`, :class:`OpSpec`, ...)
  and the builders (:func:`uniform_plan`, :func:`full_plan`, :func:`per_layer_plan`);
- :mod:`polykv.plan.groups` — allocation groups (layers whose capacities an allocator shares);
- :mod:`polykv.plan.sharing` — the checks of shared layer pairs (``LayerPlan.share``);
- :mod:`polykv.plan.provenance`, :mod:`polykv.plan.ranks`, :mod:`polykv.plan.side_files` — the optional
  sections of a plan (a solver's provenance, ranks, per-model data), read and checked only when a plan has them;
- :mod:`polykv.plan.io` — a plan file in, a checked plan out: strict reading, :func:`load_plan`, and
  :func:`validate_plan` (a plan against the registry and a model's geometry).

Everything public in :mod:`polykv.plan.records`, and :func:`load_plan` and :func:`validate_plan`, is importable
from ``polykv.plan``.
"""

from polykv.plan.records import (BASES, BUDGET_KINDS, DEFAULT_QUANTIZER, FULL_OP, FULL_RULE, MAX_BATCH,
                                 MAX_BUDGET_VALUE, MAX_CONTEXT_TOKENS, MAX_LOSS, PASSTHROUGH_BITS, PHASES,
                                 RANK_SCHEMA_VERSION, SCHEMA_VERSION, SCHEMA_VERSIONS, SHARE_SCHEMA_VERSION,
                                 STORAGE_DTYPE_BYTES, AllocationGroup, LayerPlan, ModelInfo, OpSpec, Plan, Provenance,
                                 TriggerSettings, full_plan, layer_ops, per_layer_plan, uniform_plan)
from polykv.plan.io import load_plan, validate_plan

__all__ = ["SCHEMA_VERSION", "SHARE_SCHEMA_VERSION", "RANK_SCHEMA_VERSION", "SCHEMA_VERSIONS", "FULL_RULE",
           "DEFAULT_QUANTIZER", "PASSTHROUGH_BITS", "PHASES", "BASES", "STORAGE_DTYPE_BYTES", "OpSpec", "FULL_OP",
           "LayerPlan", "TriggerSettings", "ModelInfo", "Provenance", "AllocationGroup", "Plan",
           "load_plan", "validate_plan", "uniform_plan", "full_plan", "per_layer_plan", "layer_ops",
           "MAX_CONTEXT_TOKENS", "BUDGET_KINDS", "MAX_BUDGET_VALUE", "MAX_LOSS", "MAX_BATCH"]
