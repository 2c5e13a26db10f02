"""docs/writing-adapters.md runs as written, shows the example package's real code, and is linked."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "writing-adapters.md"
EXAMPLE = REPO / "examples" / "polykv-value-norm"


def _foundation_docs_helpers():
    """tests/foundation/test_docs.py, loaded by path: its ``_python_blocks`` extracts the examples."""
    path = REPO / "tests" / "foundation" / "test_docs.py"
    spec = importlib.util.spec_from_file_location("polykv_foundation_docs_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_python_blocks = _foundation_docs_helpers()._python_blocks


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def test_python_blocks_run_in_order_in_one_namespace():
    blocks = _python_blocks(_text())
    assert len(blocks) >= 5, "the tutorial lost some of its runnable steps"
    namespace = {"__name__": "docs_example"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/writing-adapters.md#block{i}", "exec"), namespace)
    assert namespace["ValueNormRule"].name == "value-norm"
    assert namespace["registry"].entry("rule", "value-norm").plugin == "polykv-value-norm"


def test_the_rule_shown_is_the_example_package_module():
    first = _python_blocks(_text())[0]
    module = (EXAMPLE / "polykv_value_norm" / "__init__.py").read_text(encoding="utf-8")
    assert first == module, "docs/writing-adapters.md section 1 must show polykv_value_norm/__init__.py verbatim"


def test_the_pyproject_shown_is_the_example_package_pyproject():
    (toml,) = re.findall(r"^```toml\n(.*?)^```", _text(), flags=re.M | re.S)
    assert toml == (EXAMPLE / "pyproject.toml").read_text(encoding="utf-8")


def test_relative_links_resolve_and_the_index_links_the_page():
    for page in (DOC, EXAMPLE / "README.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to missing {target}"
    assert "(writing-adapters.md)" in (REPO / "docs" / "index.md").read_text(encoding="utf-8")
