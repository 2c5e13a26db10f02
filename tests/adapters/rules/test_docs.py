"""docs/rules.md documents every built-in rule and its defaults, and its code examples run."""

from __future__ import annotations

import pathlib
import re

from polykv.adapters.rules import RULES

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "rules.md"


def test_every_rule_has_a_section_with_its_defaults():
    text = DOC.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for rule in RULES:
        assert rule.name in sections, f"docs/rules.md lacks a section for rule '{rule.name}'"
        body = sections[rule.name]
        for key in ("**Definition.**", "**Signal**", "**Phases**", "**Citation.**"):
            assert key in body, f"section '{rule.name}' lacks {key}"
        for param, value in rule.defaults.items():
            shown = str(value).lower() if isinstance(value, bool) else (f'"{value}"' if isinstance(value, str) else str(value))
            assert f"`{param} = {shown}`" in body, f"section '{rule.name}' must give `{param} = {shown}`"


def test_code_examples_run(tmp_path):
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"tmp_dir": str(tmp_path)})


def test_every_builtin_allocator_is_listed_with_its_defaults():
    from polykv.adapters.rules import ALLOCATORS

    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## Allocators"):text.index("## All methods in one plan")]
    for alloc in ALLOCATORS:
        row = next((line for line in table.splitlines() if line.startswith(f"| `{alloc.name}` |")), None)
        assert row is not None, f"docs/rules.md lists no allocator '{alloc.name}'"
        for param, value in alloc.defaults.items():
            assert f"`{param} = {value}`" in row, f"allocator '{alloc.name}' must give `{param} = {value}`"
        assert alloc.paper
