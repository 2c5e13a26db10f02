"""Bad input to ``polykv solve --ray`` (refine's candidates on Ray), ``polykv calibrate --head-losses`` and a
profile's per-KV-head table (``head_metrics``) through the CLI: refused in one line naming the option or field,
before any model loads, nothing written."""

from __future__ import annotations

from cases import add, model_folder, mutate, profile_dict, write


def _solve(d, *extra: str, profile=None) -> list[str]:
    return ["solve", write(d, "prof.json", profile or profile_dict()), "--budget", "2x", "--context", "256",
            "-o", "out.plan.json", *extra]


def _refine(d, *extra: str) -> list[str]:
    return _solve(d, "--solver", "refine", "--model", model_folder(d), *extra)


SOLVE = [
    # Ray options that place nothing, or place no worker
    ("workers-without-ray", lambda d: _solve(d, "--workers", "2"), "--workers"),
    ("cpus-without-ray", lambda d: _solve(d, "--cpus-per-worker", "2"), "--cpus-per-worker"),
    ("ray-non-measuring-solver", lambda d: _solve(d, "--ray"), "--ray"),
    ("ray-address-non-measuring", lambda d: _solve(d, "--ray", "auto", "--solver", "uniform"), "--ray"),
    ("ray-workers-0", lambda d: _refine(d, "--ray", "--workers", "0"), "--workers"),
    ("ray-workers-negative", lambda d: _refine(d, "--ray", "--workers", "-2"), "--workers"),
    ("ray-cpus-0", lambda d: _refine(d, "--ray", "--cpus-per-worker", "0"), "--cpus-per-worker"),
    ("ray-cpus-nan", lambda d: _refine(d, "--ray", "--cpus-per-worker", "nan"), "--cpus-per-worker"),
    ("ray-workers-text", lambda d: _refine(d, "--ray", "--workers", "two"), "--workers"),
]
for _id, _setup, _expect in SOLVE:
    add(f"router2-solve-{_id}", "cli", _setup, _expect, ("out.plan.json",))


def _heads(values) -> dict:
    """The reliability profile (2 layers, 2 KV heads, 12 configs) with a per-head table."""
    return mutate(profile_dict(), "head_metrics", values)


def _table(**at) -> list:
    """A [2][2][12] table of 0.1, with ``at={"l,h,c": value}`` changed."""
    t = [[[0.1] * 12 for _ in range(2)] for _ in range(2)]
    for key, v in at.items():
        l, h, c = (int(x) for x in key.split("_")[1:])
        t[l][h][c] = v
    return t


HEADS = [
    ("not-an-object", [1, 2], "head_metrics"),
    ("unknown-metric", {"kl": _table()}, "head_metrics.kl"),
    ("two-dimensional", {"l2": [[0.1] * 12, [0.1] * 12]}, "head_metrics.l2"),
    ("one-head-short", {"l2": [t[:1] for t in _table()]}, "head_metrics.l2"),
    ("one-config-short", {"l2": [[row[:11] for row in t] for t in _table()]}, "head_metrics.l2"),
    ("three-layers", {"l2": _table() + _table()[:1]}, "head_metrics.l2"),
    ("ragged", {"l2": [[[0.1] * 12, [0.1] * 11], [[0.1] * 12, [0.1] * 12]]}, "head_metrics.l2"),
    ("negative", {"l2": _table(at_1_1_3=-0.5)}, "head_metrics.l2"),
    ("huge", {"l2": _table(at_0_1_3=1e300)}, "head_metrics.l2"),
    ("text", {"l2": _table(at_0_0_0="a")}, "head_metrics.l2"),
    ("bool", {"l2": _table(at_0_0_0=True)}, "head_metrics.l2"),
    ("null-value", {"l2": _table(at_0_0_0=None)}, "head_metrics.l2"),
    ("table-null", {"l2": None}, "head_metrics.l2"),
]
for _id, _values, _expect in HEADS:
    add(f"router2-head-metrics-{_id}", "profile", lambda d, v=_values: _solve(d, profile=_heads(v)), _expect,
        ("out.plan.json",))

# per-KV-head losses of rank configs are not measured: refused before the model loads
add("router2-calibrate-head-losses-with-ranks", "cli",
    lambda d: ["calibrate", model_folder(d), "-o", "x.profile.json", "--head-losses", "--ranks", "d,d/2"],
    "--head-losses", ("x.profile.json", "x.qstats.safetensors"))
