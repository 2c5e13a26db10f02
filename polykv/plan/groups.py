"""Allocation groups in plan files: the optional top-level ``"allocation"`` list.

``"allocation": [{"allocator": "cake", "layers": [2, 3, 4], "params": {"window": 32}}]`` puts
layers 2-4 under the ``cake`` allocator; their planned prefill capacities add up to the group's
total budget. A plan without the key is exactly a version-1 plan of before (it is written only
when a plan has groups), so ``schema_version`` stays 1.
"""

from __future__ import annotations

from typing import Any

from polykv.errors import PlanError, PolykvError
from polykv.plan.records import AllocationGroup, Plan


def parse_groups(reader, raw: Any) -> tuple[AllocationGroup, ...]:
    """Parse the ``allocation`` list with the plan's :class:`~polykv.strict_json.FieldReader` (errors name
    file and field)."""
    reader.list_(raw, "allocation", what="a list of allocation groups")
    groups = []
    for i, entry in enumerate(raw):
        field = f"allocation[{i}]"
        reader.obj(entry, field, ["allocator", "layers"], ["params"])
        name = reader.str_(entry["allocator"], field + ".allocator")
        layers = reader.list_(entry["layers"], field + ".layers", nonempty=True,
                              what="a non-empty list of layer indices")
        idx = [reader.int_(v, f"{field}.layers[{j}]", minimum=0) for j, v in enumerate(layers)]
        if idx != sorted(set(idx)):
            reader.fail("layers must be ascending and distinct", field=field + ".layers",
                        hint="e.g. [0, 1, 2, 3]")
        params = reader.dict_(entry.get("params", {}), field + ".params")
        groups.append(AllocationGroup(allocator=name, layers=tuple(idx), params=params))
    return tuple(groups)


def check_groups(plan: Plan, *, source: str) -> None:
    """Members exist, belong to one group, and evict in prefill (the allocators and their params are checked
    against the registry by :func:`polykv.plan.io.validate_plan`)."""
    seen: dict[int, int] = {}
    for gi, g in enumerate(plan.allocation):
        field = f"allocation[{gi}]"
        for layer in g.layers:
            if layer >= plan.num_layers:
                raise PlanError(f"group names layer {layer} but the plan has {plan.num_layers} layers",
                                source=source, field=field + ".layers", hint="name existing layers only")
            if layer in seen:
                raise PlanError(f"layer {layer} is in allocation groups {seen[layer]} and {gi}", source=source,
                                layer=layer, field=field + ".layers", hint="put every layer in at most one group")
            seen[layer] = gi
            if plan.layers[layer].prefill.keeps_everything:
                raise PlanError("a layer in an allocation group needs a prefill rule with a capacity (its share "
                                "of the group's budget)", source=source, layer=layer,
                                field=f"layers[{layer}].prefill.rule",
                                hint="route the layer's prefill to an eviction rule, or leave it out of the group")


def check_group_bounds(plan, registry, context_tokens: int, *, source: str) -> None:
    """Every group's allocator can budget its layers at ``context_tokens`` (e.g. a pyramid window below
    the group's average); an allocator's refusal names the group's field and the parameter it gives."""
    for gi, g in enumerate(plan.allocation):
        caps = [plan.layers[i].prefill.kept_tokens(context_tokens) for i in g.layers]
        try:
            registry.allocator(g.allocator)(**g.params).bound(caps, context_tokens)
        except (PolykvError, TypeError, ValueError) as exc:
            param = getattr(exc, "param", None)
            raise PlanError(f"at {context_tokens} context tokens: {exc}", source=source,
                            field=f"allocation[{gi}].params" + (f".{param}" if param else "")) from None
