"""The examples in docs/studies-guide.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "studies-guide.md"


def test_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert blocks, "the guide should carry at least one executable example"
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), {})
