"""``pytest -m "not slow"`` stays quick: tests/conftest.py fails a test that is not marked slow when it (or
one of its fixtures) starts a process or runs a Triton kernel in Triton's CPU interpreter, refuses a test
on the real-model fixture without the ``model`` marker, and makes ``model`` tests slow.

Each case runs in a nested pytest session on a folder holding a copy of tests/conftest.py and the
markers of pyproject.toml; the processes are refused before they start, so none is started here.
"""

from __future__ import annotations

import os
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class _Reports:
    def __init__(self) -> None:
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.deselected: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid.split("::")[-1]] = (report.outcome, str(report.longrepr or ""))

    def pytest_deselected(self, items) -> None:
        self.deselected += [item.name for item in items]


def _session(folder: Path, source: str, *args: str) -> tuple[int, _Reports]:
    (folder / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text(encoding="utf-8"))
    markers = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"][
        "ini_options"]["markers"]
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    # a file name of its own: a nested session would reuse a module of the same name from an earlier one
    (folder / f"test_{folder.name}.py").write_text(textwrap.dedent(source))
    reports = _Reports()
    # no:unraisableexception: that plugin ends a session with full garbage collections, seconds each in a
    # process that has run most of the suite (its heap holds every module and model the suite loaded)
    code = pytest.main([str(folder), "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                        "--import-mode=importlib",
                        "--rootdir", str(folder), "-c", str(folder / "pytest.ini"), *args], plugins=[reports])
    return int(code), reports


def test_an_unmarked_test_or_fixture_that_starts_a_process_fails_naming_the_mark(tmp_path, capsys):
    code, reports = _session(tmp_path, """
        import subprocess, sys
        import pytest

        @pytest.fixture
        def spawns():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_starts_one():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_fixture_starts_one(spawns):
            pass

        def test_starts_none():
            assert subprocess.list2cmdline(["a", "b"]) == "a b"
    """)
    assert code == 1
    for name in ("test_starts_one", "test_fixture_starts_one"):
        outcome, text = reports.outcomes[name]
        assert outcome == "failed" and "starts a process" in text and "@pytest.mark.slow" in text, text
    assert reports.outcomes["test_starts_none"][0] == "passed"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or "triton.runtime.interpreter" not in sys.modules,
                    reason="Triton's CPU interpreter is used only without a GPU")
def test_an_unmarked_interpreted_triton_launch_fails(tmp_path, capsys):
    code, reports = _session(tmp_path, """
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def copy(x_ptr, y_ptr):
            tl.store(y_ptr, tl.load(x_ptr))

        def test_launches():
            copy[(1,)](torch.ones(1), torch.zeros(1))
    """)
    outcome, text = reports.outcomes["test_launches"]
    assert code == 1 and outcome == "failed" and "Triton's CPU interpreter" in text, text


def test_the_real_model_fixture_needs_the_model_marker(tmp_path, capsys):
    code, _ = _session(tmp_path, """
        def test_on_the_model(default_geometry):
            pass
    """, "--collect-only")
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "test_on_the_model uses the real-model fixture 'default_model'" in capsys.readouterr().err


def test_model_tests_are_slow_and_left_out_of_the_quick_subset(tmp_path, capsys):
    code, reports = _session(tmp_path, """
        import pytest

        @pytest.fixture(scope="session")
        def default_model():
            return None

        @pytest.mark.model
        def test_on_the_model(default_model):
            pass

        def test_quick():
            pass
    """, "-m", "not slow")
    assert code == 0 and reports.deselected == ["test_on_the_model"]
    assert reports.outcomes["test_quick"][0] == "passed"
