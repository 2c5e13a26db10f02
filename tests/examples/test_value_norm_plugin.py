"""The example plugin under examples/polykv-value-norm installs like any third-party package and works.

It is pip-installed into a private folder; fresh interpreters that see only that folder (through
``PYTHONPATH``, from a temporary working directory, so the checkout's ``adapters/`` folder is never a
bare module) must list its rule with the distribution's name and version, and run a plan routing the
rule to some layers of a tiny model, keeping exactly what a naive re-computation keeps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pip-installs the example and runs fresh interpreters

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "polykv-value-norm"
PROBE = Path(__file__).with_name("value_norm_probe.py")
PYPROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the installed example (built from a copy, so the checkout stays clean)."""
    root = tmp_path_factory.mktemp("value-norm")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    target = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return target


def _run(args: list[str], cwd: Path, pythonpath: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POLYKV_NO_PLUGINS")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _value_norm_rows(stdout: str) -> list[dict]:
    return [row for row in json.loads(stdout) if row["kind"] == "rule" and row["name"] == "value-norm"]


def test_polykv_plugins_lists_the_rule_with_its_distribution(site, tmp_path):
    cli = Path(sys.executable).with_name("polykv")
    assert cli.exists(), f"the polykv console script is missing next to {sys.executable}"
    rows = _value_norm_rows(_run([str(cli), "plugins", "--json"], tmp_path, site))
    (entry_point,) = PYPROJECT["entry-points"]["polykv"]
    assert rows == [{"kind": "rule", "name": "value-norm", "plugin": entry_point,
                     "version": PYPROJECT["version"], "phases": ["decode", "prefill"], "signal": "none",
                     "paper": "Guo et al., Value Also Matters (VATP), EMNLP 2024 (arXiv:2406.12335)"}]
    # Without the installed folder the rule is unknown: the entry point, not the checkout, provided it.
    assert _value_norm_rows(_run([str(cli), "plugins", "--json"], tmp_path, None)) == []


def test_plan_routing_the_rule_runs_and_keeps_what_a_naive_selection_keeps(site, tmp_path):
    got = json.loads(_run([sys.executable, str(PROBE)], tmp_path, site).strip().splitlines()[-1])
    assert Path(got["module"]).resolve().is_relative_to(site.resolve()), got["module"]
    assert got["bare_adapters"] is None or str(REPO) not in got["bare_adapters"], got["bare_adapters"]
    assert (got["plugin"], got["version"]) == ("polykv-value-norm", PYPROJECT["version"])
    assert got["generated"] == [1, 30] and got["forwards"] == 10  # 20-token prompt + 10 new tokens
    assert got["kept"] == got["want"]
    counts = [len(layer[0][0]) for layer in got["kept"]]
    assert counts[1] == 29, "layer 1 keeps everything (full) and stores every token fed so far"
    assert counts[0] <= 12 + 2 and counts[2] <= 16 + 2, counts  # capacity + decode slack
    assert got["kept"][0][0][0][:2] == [0, 1], "layer 0 keeps its two sinks"
    assert got["tensor_cases"] == 72
