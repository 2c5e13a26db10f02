"""Bad input to a probe rule (kvzip) through the CLI: refused when the plan is read, naming the layer and field."""

from __future__ import annotations

from cases import add, mutate, plan_dict, write

IDS = {"repeat_ids": [5, 6], "continue_ids": [7], "suffix_ids": [8]}

PROBE_PLANS = [
    # decode has no prompt to probe: kvzip serves the prefill op only
    ("kvzip-in-decode", mutate(plan_dict(), "layers.1.decode", {"rule": "kvzip", "capacity": 16, "params": IDS}),
     "layers[1].decode"),
    ("kvzip-ids-not-ints", mutate(plan_dict(), "layers.0.prefill", {"rule": "kvzip", "capacity": 16,
                                                                     "params": dict(IDS, repeat_ids=["a"])}),
     "layers[0].prefill.params.repeat_ids'"),
    ("kvzip-ids-not-a-list", mutate(plan_dict(), "layers.0.prefill", {"rule": "kvzip", "capacity": 16,
                                                                       "params": dict(IDS, suffix_ids=8)}),
     "layers[0].prefill.params.suffix_ids'"),
    ("kvzip-sink-unknown", mutate(plan_dict(), "layers.0.prefill", {"rule": "kvzip", "capacity": 16,
                                                                     "params": dict(IDS, sink="all")}),
     "layers[0].prefill.params.sink'"),
]
for _id, _plan, _expect in PROBE_PLANS:
    add(f"probe-{_id}", "plan", lambda d, p=_plan: ["plan", "validate", write(d, "p.json", p)], _expect)
