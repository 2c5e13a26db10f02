"""docs/solver-api.md runs as written, and the index links it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "solver-api.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_the_example_solver_registers_solves_and_prices_off_the_grid():
    blocks = _python_blocks(DOC.read_text(encoding="utf-8"))
    assert len(blocks) == 3, "the page lost some of its runnable steps"
    namespace = {"__name__": "docs_solver_api"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/solver-api.md#block{i}", "exec"), namespace)
    plan = namespace["plan"]
    assert namespace["registry"].entry("solver", "docs-even-keep").plugin == "my-solvers"
    assert plan.provenance.note.startswith("keep ") and plan.provenance.context_tokens == 1024


def test_relative_links_resolve_and_the_index_links_the_page():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", DOC.read_text(encoding="utf-8")):
        assert (DOC.parent / target).exists(), f"docs/solver-api.md links to missing {target}"
    assert "(solver-api.md)" in (REPO / "docs" / "index.md").read_text(encoding="utf-8")
