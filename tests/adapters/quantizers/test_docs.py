"""docs/quantizers.md documents every built-in quantizer and its defaults, and its code examples run."""

import pathlib
import re

from polykv.adapters.quantizers import QUANTIZERS

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "quantizers.md"


def test_every_quantizer_has_a_section_with_its_defaults():
    text = DOC.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for quantizer in QUANTIZERS:
        assert quantizer.name in sections, f"docs/quantizers.md lacks a section for '{quantizer.name}'"
        body = sections[quantizer.name]
        for key in ("**Definition.**", "**Widths**", "**Citation.**", "**Bytes**"):
            assert key in body, f"section '{quantizer.name}' lacks {key}"
        for param, value in quantizer.defaults.items():
            assert f"`{param} = {value}`" in body, f"section '{quantizer.name}' must give `{param} = {value}`"


def test_code_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
