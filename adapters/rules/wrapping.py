"""Rules that wrap another registered rule (``cam`` around any eviction rule, ``adakv`` around a scored one)."""

from __future__ import annotations

from typing import Any, Mapping

from polykv.operators import RetentionRule


def build_inner_rule(wrapper: str, name: Any, params: Mapping[str, Any] | None) -> RetentionRule:
    """The inner rule ``name`` built with ``params`` from the process registry.

    Raises ValueError (plan validation reports it with the layer and field) when the name is not a
    registered rule, is ``full`` or the wrapper itself, or the parameters are wrong.
    """
    from polykv.registry import get_registry

    if not isinstance(name, str) or name in ("full", wrapper):
        raise ValueError(f"rule '{wrapper}': parameter 'rule' must name another eviction rule, got {name!r}")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"rule '{wrapper}': parameter 'rule_params' must be an object, got {params!r}")
    registry = get_registry()
    if not registry.has("operator", name):
        raise ValueError(f"rule '{wrapper}': unknown inner rule {name!r}; available: {registry.names('operator')}")
    try:
        return registry.operator(name)(**dict(params or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rule '{wrapper}': inner rule '{name}': {exc}") from None
