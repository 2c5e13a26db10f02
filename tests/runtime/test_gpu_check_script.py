"""bench/gpu_check.py runs end to end on CPU at toy sizes, so it is known to work when a GPU is lent."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_runs_every_section_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("polykv_gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--device", "cpu", "--small", "--time-limit", "900"])
    out = capsys.readouterr().out
    assert rc == 0, out
    titles = re.findall(r"^== (.+)$", out, flags=re.M)
    assert len(titles) == 7 and len(re.findall(r"^   ok ", out, flags=re.M)) == 7, out
    assert "FAIL" not in out and "skipped" not in out
    rows = re.findall(r"^    (\S+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+n/a$", out, flags=re.M)
    names = ["vanilla", "full"] + [f"{r}@8x" for r in mod.EVICTION_RULES] + ["K4V4"]
    assert rows == [(n, str(c)) for c in (256, 512) for n in names], out
    assert "gpu_check: all checks passed" in out
