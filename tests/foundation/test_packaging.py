"""The repository's adapters/ folder installs as ``polykv.adapters`` and never as a bare ``adapters``.

Proved three ways: under pytest, in the editable install (a fresh interpreter outside the checkout),
and in a wheel built from a copy of the sources and installed into a private folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import polykv

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.util, json, sys
import polykv, polykv.adapters, polykv.adapters.rules, polykv.adapters.quantizers
spec = importlib.util.find_spec("adapters")
print(json.dumps({
    "polykv": polykv.__file__,
    "adapters_pkg": polykv.adapters.__file__,
    "rules": polykv.adapters.rules.__file__,
    "quantizers": polykv.adapters.quantizers.__file__,
    "bare_adapters": None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or []))),
    "rule_names": sorted(r.name for r in polykv.adapters.rules.RULES),
}))
"""


def _probe(cwd: Path, extra_env: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def _not_ours(bare: str | None, *folders: Path) -> bool:
    """A bare ``adapters`` is either absent or some other project's module, never one of ``folders``."""
    return bare is None or not any(str(f.resolve()) in bare for f in folders)


def test_under_pytest_adapters_is_namespaced():
    import importlib.util

    import polykv.adapters.rules

    assert _inside(polykv.adapters.rules.__file__, REPO / "adapters")
    assert polykv.adapters.rules.RULES, "the built-in rules should be importable as polykv.adapters.rules"
    spec = importlib.util.find_spec("adapters")
    assert spec is None or not _inside(spec.origin or "", REPO), spec
    assert "adapters" not in sys.modules or not _inside(sys.modules["adapters"].__file__ or "", REPO)


@pytest.mark.slow
def test_editable_install_maps_adapters(tmp_path):
    got = _probe(tmp_path)
    assert _inside(got["polykv"], REPO / "polykv")
    assert _inside(got["adapters_pkg"], REPO / "adapters")
    assert _inside(got["rules"], REPO / "adapters" / "rules")
    assert _not_ours(got["bare_adapters"], REPO / "adapters"), got
    assert got["rule_names"], "no built-in rules found through polykv.adapters.rules"


@pytest.mark.slow
def test_wheel_install_maps_adapters(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for name in ("polykv", "adapters"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("polykv_compose-*.whl")
    inst = subprocess.run(pip + ["install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    assert not (target / "adapters").exists(), "the wheel installs a top-level adapters/ package"
    assert (target / "polykv" / "adapters" / "rules" / "__init__.py").is_file()

    got = _probe(tmp_path, {"PYTHONPATH": str(target)})
    assert _inside(got["polykv"], target), got
    assert _inside(got["adapters_pkg"], target), got
    assert _inside(got["rules"], target), got
    assert _not_ours(got["bare_adapters"], target, REPO / "adapters"), got
    import polykv.adapters.rules as here

    assert got["rule_names"] == sorted(r.name for r in here.RULES)


def test_distribution_name_differs_from_taken_pypi_names():
    import importlib.metadata

    dist = importlib.metadata.distribution("polykv-compose")
    assert dist.metadata["Name"] not in ("polykv", "polykv-llm")
    assert dist.version == polykv.__version__
