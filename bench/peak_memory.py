"""Peak process memory of one prefill, vanilla against a compressed run, each in a fresh subprocess.

Shared by ``bench/kvzip_cost.py`` and ``bench/kvzap_cost.py``: the child reports its resident memory right
before the prefill (:func:`rss_now`) and its peak (``ru_maxrss``, the basis) as one JSON line
(:func:`report`); :func:`compare` runs both children and prints the ratio of peaks and of the prefill's own
increments (peak minus the memory before it, the stricter basis).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def rss_now() -> int:
    """Resident memory of this process now, KiB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() // 1024


def report(kind: str, before_kib: int) -> None:
    """The child's last line: its memory before the prefill and its peak."""
    print(json.dumps({"kind": kind, "before_kib": before_kib,
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)


def compare(script: str, T: int, name: str, child_args: list[str]) -> None:
    """Run ``script --child vanilla|NAME *child_args`` in fresh processes and print the two ratios."""
    got = {}
    for kind in ("vanilla", name):
        run = subprocess.run([sys.executable, script, "--child", kind, *child_args], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"the {kind} run failed: {run.stderr.strip().splitlines()[-1]}")
        got[kind] = json.loads(run.stdout.strip().splitlines()[-1])
    v, k = got["vanilla"], got[name]
    dv, dk = v["peak_kib"] - v["before_kib"], k["peak_kib"] - k["before_kib"]
    print(f"peak memory at {T} tokens (ru_maxrss of a fresh process each): vanilla {v['peak_kib'] / 1024:.0f} MiB, "
          f"{name} {k['peak_kib'] / 1024:.0f} MiB, ratio {k['peak_kib'] / v['peak_kib']:.3f}x; the prefill's own "
          f"increment: vanilla {dv / 1024:.0f} MiB, {name} {dk / 1024:.0f} MiB, ratio {dk / max(dv, 1):.3f}x",
          flush=True)
