"""Bad inputs of the runtime's area: allocation groups whose rules disagree with their allocator, and a
trigger that would evict before anything was decoded."""

from __future__ import annotations

from cases import add, plan_dict, write


def _cake_plan(rule_window: int | None, group_window: int | None) -> dict:
    plan = plan_dict()
    params = {} if rule_window is None else {"window": rule_window}
    for lp in plan["layers"]:
        lp["prefill"] = {"rule": "cake", "capacity": 40, "params": dict(params)}
        lp["decode"] = {"rule": "cake", "capacity": 40, "params": dict(params)}
        lp["k_bits"] = lp["v_bits"] = 16
        lp.pop("quantizer", None)
    plan["allocation"] = [{"allocator": "cake", "layers": [0, 1],
                           "params": {} if group_window is None else {"window": group_window}}]
    return plan


for _id, _rule, _group in [("rule-8-allocator-default", 8, None), ("rule-default-allocator-8", None, 8),
                           ("rule-16-allocator-8", 16, 8)]:
    add(f"plan-cake-window-{_id}", "plan",
        lambda d, r=_rule, g=_group: ["plan", "validate", write(d, "p.json", _cake_plan(r, g))],
        "layers[0].prefill.params.window")
