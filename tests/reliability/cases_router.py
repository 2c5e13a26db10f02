"""Bad input to the solvers that choose an allocation group (``global``; ``refine`` with ``start`` and
``objectives``) through the CLI: refused in one line naming the parameter, before any model loads, nothing written."""

from __future__ import annotations

from cases import add, model_folder, profile_dict, write


def _solve(d, *extra):
    return ["solve", write(d, "prof.json", profile_dict()), "--budget", "2x", "--context", "256",
            "-o", "out.plan.json", *extra]


GLOBAL = [  # the profile measured snapkv only (widths 16 and 8)
    ("allocator-unset", [], "allocator"),
    ("allocator-unknown", ["--param", "allocator=nope"], "allocator"),
    ("allocator-not-text", ["--param", "allocator=3"], "allocator"),
    ("rule-unprofiled", ["--param", "allocator=kvzip"], "'kvzip'"),      # the kvzip allocator's rule
    ("rule-unregistered", ["--param", "allocator=pyramidkv", "--param", "rule=nope"], "'nope'"),
    ("allocator-reads-another-rule", ["--param", "allocator=kvzip", "--param", "rule=snapkv"], "rule"),
    ("rules-leave-out-group", ["--param", "allocator=pyramidkv", "--param", "rule=snapkv", "--param",
                               'rules=["full"]'], "rules"),
    ("rules-unprofiled", ["--param", "allocator=pyramidkv", "--param", "rule=snapkv", "--param",
                          'rules=["snapkv","tova"]'], "rules"),
    ("shares-unknown", ["--param", "allocator=kvzip", "--param", "shares=even"], "shares"),
    ("k-bits-unmeasured", ["--param", "allocator=pyramidkv", "--param", "rule=snapkv", "--param", "k_bits=4"], "K4"),
    ("k-bits-invalid", ["--param", "k_bits=3"], "k_bits"),
    ("v-bits-text", ["--param", "v_bits=wide"], "v_bits"),
    ("unknown-param", ["--param", "group=all"], "group"),
    ("metric-unknown", ["--param", "allocator=pyramidkv", "--param", "rule=snapkv", "--param", "metric=kl_mix"],
     "kl_mix"),
]
for _id, _args, _expect in GLOBAL:
    add(f"solve-global-{_id}", "cli", lambda d, a=_args: _solve(d, "--solver", "global", *a), _expect,
        outputs=("out.plan.json",))

REFINE = [  # refused before the model loads (the folder holds a config only)
    ("start-unknown", ["--param", "start=greedy"], "start"),
    ("start-global-allocator-unknown", ["--param", "start=global", "--param", "allocator=nope"], "allocator"),
    ("start-global-allocator-unset", ["--param", "start=global"], "allocator"),
    ("start-global-rule-unprofiled", ["--param", "start=global", "--param", "allocator=kvzip"], "kvzip"),
    ("objectives-unknown", ["--param", 'objectives=["recall"]'], "objectives"),
    ("objectives-number", ["--param", "objectives=3"], "objectives"),
    ("objectives-empty", ["--param", "objectives=[]"], "objectives"),
]
for _id, _args, _expect in REFINE:
    add(f"solve-refine-{_id}", "cli", lambda d, a=_args: _solve(d, "--solver", "refine", "--model", model_folder(d),
                                                                 *a), _expect, outputs=("out.plan.json",))

CALIBRATE_RAY = [  # refused with the other options, before the model loads
    ("workers-without-ray", ["--workers", "2"], "--ray"),
    ("cpus-without-ray", ["--cpus-per-worker", "2"], "--ray"),
    ("ray-zero-workers", ["--ray", "--workers", "0"], "--workers"),
    ("ray-zero-cpus", ["--ray", "--cpus-per-worker", "0"], "--cpus-per-worker"),
]
for _id, _args, _expect in CALIBRATE_RAY:
    add(f"calibrate-{_id}", "cli", lambda d, a=_args: ["calibrate", model_folder(d), "-o", "x.profile.json", *a],
        _expect, outputs=("x.profile.json",))
