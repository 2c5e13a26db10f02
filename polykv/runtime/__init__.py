"""Runtime: execute a per-layer, per-phase Plan on a transformers model.

``apply(model, plan)`` validates the plan and returns a :class:`Session` used as a context manager;
see ``docs/runtime.md``.
"""

from polykv.runtime.cache import PlanCache
from polykv.runtime.layer_cache import LayerCache
from polykv.runtime.session import ResidentBytes, Session, apply

__all__ = ["apply", "Session", "PlanCache", "LayerCache", "ResidentBytes"]
