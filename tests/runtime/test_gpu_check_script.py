"""bench/gpu_check.py runs end to end on CPU at toy sizes, so it is known to work when a GPU is lent.

It runs as a script in its own process, as it is meant to be run (it registers the masked-reference
attention of tests/runtime/test_masked_reference.py under that test's name, which must not replace
the registration of the test module itself in this process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs bench/gpu_check.py in a process

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
RULES = ("streamingllm", "snapkv", "h2o", "tova")  # bench/gpu_check.py EVICTION_RULES


def test_gpu_check_runs_every_section_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--time-limit", "900"],
                          capture_output=True, text=True, env=env, timeout=1200)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    titles = re.findall(r"^== (.+)$", out, flags=re.M)
    assert len(titles) == 10 and len(re.findall(r"^   ok ", out, flags=re.M)) == 10, out
    summary = out[out.index("\nsummary:\n"):]
    assert re.findall(r"^  (\S+)\s+[\d.]+ s  (.+)$", summary, flags=re.M) == [("ok", t) for t in titles], summary
    assert "FAIL" not in out and "skipped" not in out
    rows = re.findall(r"^    (\S+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+n/a$", out, flags=re.M)
    names = ["vanilla", "full"] + [f"{r}@8x" for r in RULES] + ["K4V4"]
    assert rows == [(n, str(c)) for c in (256, 512) for n in names], out
    assert "gpu_check: all checks passed" in out
