"""Rules that wrap another registered rule (``cam`` around any eviction rule, ``adakv`` around a scored one)."""

from __future__ import annotations

from typing import Any, Mapping

from polykv.contract import ParamError, RetentionRule, registered_rule


def build_inner_rule(wrapper: str, name: Any, params: Mapping[str, Any] | None) -> RetentionRule:
    """The inner rule ``name`` built with ``params`` from the process registry.

    Raises :class:`~polykv.contract.params.ParamError` (a ValueError) when the name is not a registered rule,
    is ``full`` or the wrapper itself (``param`` = ``"rule"``), or the inner parameters are wrong
    (``param`` = ``"rule_params"`` or ``"rule_params.<name>"``), so plan validation names the field,
    e.g. ``layers[3].prefill.params.rule_params.window``.
    """
    if not isinstance(name, str) or name in ("full", wrapper):
        raise ParamError("rule", f"rule '{wrapper}': parameter 'rule' must name another eviction rule, "
                                 f"got {name!r}")
    if params is not None and not isinstance(params, Mapping):
        raise ParamError("rule_params", f"rule '{wrapper}': parameter 'rule_params' must be an object, got {params!r}")
    try:
        rule_class = registered_rule(name)
    except ParamError as exc:                # "unknown rule 'x'; available: [...]"
        raise ParamError("rule", f"rule '{wrapper}': {str(exc).replace('unknown rule', 'unknown inner rule', 1)}") \
            from None
    try:
        return rule_class(**dict(params or {}))
    except (TypeError, ValueError) as exc:
        inner = getattr(exc, "param", None)
        raise ParamError("rule_params" + (f".{inner}" if inner else ""),
                         f"rule '{wrapper}': inner rule '{name}': {exc}") from None
