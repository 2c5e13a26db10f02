"""Plans: for every layer and phase, which retention rule runs, how much it keeps, and at how many bits.

- :mod:`polykv.plan.records` — the attrs records (:class:`Plan`, :class:`LayerPlan`, :class:`OpSpec`, ...)
  and the builders (:func:`uniform_plan`, :func:`full_plan`, :func:`per_layer_plan`);
- :mod:`polykv.plan.io` — the JSON file format: writing, strict parsing, validation against the
  registry and a model's geometry;
- :mod:`polykv.plan.groups` — allocation groups (layers whose capacities an allocator shares);
- :mod:`polykv.plan.sharing` — the checks of shared layer pairs (``LayerPlan.share``).

Everything public in :mod:`polykv.plan.records` is importable from ``polykv.plan``.
"""

from polykv.plan.records import (BUDGET_KINDS, DEFAULT_QUANTIZER, FULL_OP, FULL_RULE, MAX_BATCH, MAX_BUDGET_VALUE,
                                 MAX_CONTEXT_TOKENS, MAX_LOSS, OPTIONAL_PROVENANCE, PASSTHROUGH_BITS, SCHEMA_VERSION,
                                 RANK_SCHEMA_VERSION, SCHEMA_VERSIONS, SHARE_SCHEMA_VERSION,
                                 AllocationGroup, LayerPlan, ModelInfo, OpSpec, Plan, Provenance, TriggerSettings,
                                 full_plan, layer_ops, load_plan, per_layer_plan, uniform_plan)

__all__ = ["SCHEMA_VERSION", "SHARE_SCHEMA_VERSION", "RANK_SCHEMA_VERSION", "SCHEMA_VERSIONS", "FULL_RULE",
           "DEFAULT_QUANTIZER", "PASSTHROUGH_BITS", "OpSpec", "FULL_OP", "LayerPlan",
           "TriggerSettings", "ModelInfo", "Provenance", "OPTIONAL_PROVENANCE", "AllocationGroup", "Plan",
           "load_plan", "uniform_plan", "full_plan", "per_layer_plan", "layer_ops", "MAX_CONTEXT_TOKENS", "BUDGET_KINDS",
           "MAX_BUDGET_VALUE", "MAX_LOSS", "MAX_BATCH"]
