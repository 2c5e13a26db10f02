"""Bad parameters of every plugin kind and quantizers that disagree with the profile, through the CLI.

Rule, quantizer and allocator parameters are checked against their declared ParamSpecs when a plan is
validated (the line names the plugin, layer and field); `polykv solve` refuses a quantizer other than
the one the profile was calibrated with, and a profile's quantizer record is read strictly.
"""

from __future__ import annotations

from cases import add, mutate, plan_dict, profile_dict, write


def _validate(d, plan):
    return ["plan", "validate", write(d, "p.json", plan)]


def _group(allocator: str, params: dict) -> dict:
    return mutate(plan_dict(), "allocation", [{"allocator": allocator, "layers": [0], "params": params}])


PLAN_PARAMS = [
    ("qparams-group-str", mutate(plan_dict(), "layers.0.quantizer_params", {"group_size": "32"}),
     "layers[0].quantizer_params.group_size'"),
    ("qparams-residual-float", mutate(plan_dict(), "layers.0.quantizer_params", {"residual": 32.5}),
     "layers[0].quantizer_params.residual'"),
    ("qparams-group-null", mutate(plan_dict(), "layers.0.quantizer_params", {"group_size": None}),
     "layers[0].quantizer_params.group_size'"),
    ("allocator-cake-window-str", _group("cake", {"window": "32"}), "allocation[0].params.window'"),
    ("allocator-cake-tau-zero", _group("cake", {"tau1": 0}), "allocation[0].params.tau1'"),
    ("allocator-cake-tau-str", _group("cake", {"tau2": "1"}), "allocation[0].params.tau2'"),
    ("allocator-pyramidkv-beta-str", _group("pyramidkv", {"beta": "20"}), "allocation[0].params.beta'"),
    ("allocator-pyramidkv-window-neg", _group("pyramidkv", {"window": -1}), "allocation[0].params.window'"),
    ("allocator-unknown-param", _group("d2o", {"min_tokens": 64}), "allocation[0].params'"),
    ("snapkv-kernel-even", mutate(plan_dict(), "layers.0.prefill.params", {"window": 8, "kernel_size": 4}),
     "layers[0].prefill.params.kernel_size'"),
    ("pyramidkv-kernel-even", mutate(plan_dict(), "layers.0.prefill", {"rule": "pyramidkv", "capacity": 64,
                                                                        "params": {"kernel_size": 6}}),
     "layers[0].prefill.params.kernel_size'"),
]
for _id, _plan, _expect in PLAN_PARAMS:
    add(f"plan-param-{_id}", "plan", lambda d, p=_plan: _validate(d, p), _expect)


def _solve(d, profile, *extra):
    return ["solve", write(d, "prof.json", profile), "--budget", "4x", "--context", "256", "-o", "out.plan.json",
            *extra]


FP8_PROFILE = mutate(profile_dict(), "quantizer", {"name": "fp8", "params": {}})
SOLVE_QUANTIZER = [
    ("other-name", profile_dict(), ["--quantizer", "fp8"], "calibrated with quantizer 'kivi', not 'fp8'"),
    ("other-params", profile_dict(), ["--quantizer", "kivi", "--quantizer-param", "group_size=16"],
     "calibrated with quantizer 'kivi', not 'kivi' {'group_size': 16}"),
    ("params-alone", profile_dict(), ["--quantizer-param", "residual=64"], "calibrated with quantizer 'kivi'"),
    ("fp8-profile-as-kivi", FP8_PROFILE, ["--quantizer", "kivi"], "calibrated with quantizer 'fp8', not 'kivi'"),
    ("fp8-not-installed", FP8_PROFILE, [], "unknown quantizer 'fp8'"),
    ("bad-param-syntax", profile_dict(), ["--quantizer", "kivi", "--quantizer-param", "group_size"],
     "--quantizer-param"),
]
for _id, _profile, _extra, _expect in SOLVE_QUANTIZER:
    add(f"solve-quantizer-{_id}", "profile", lambda d, p=_profile, e=_extra: _solve(d, p, *e), _expect,
        ("out.plan.json",))

PROFILE_QUANTIZER = [
    ("string", "kivi", "field 'quantizer'"),
    ("no-name", {"params": {}}, "field 'quantizer.name'"),
    ("name-int", {"name": 5}, "field 'quantizer.name'"),
    ("name-empty", {"name": ""}, "field 'quantizer.name'"),
    ("params-list", {"name": "kivi", "params": [1]}, "field 'quantizer.params'"),
    ("extra-key", {"name": "kivi", "bits": 8}, "field 'quantizer'"),
]
for _id, _value, _expect in PROFILE_QUANTIZER:
    add(f"profile-quantizer-{_id}", "profile",
        lambda d, v=_value: _solve(d, mutate(profile_dict(), "quantizer", v)), _expect, ("out.plan.json",))
