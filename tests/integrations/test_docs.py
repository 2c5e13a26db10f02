"""The Python examples in docs/integrations.md run as written (on the default model, offline)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


@pytest.mark.model
def test_integrations_page_examples_run(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 3, "the page carries the generate/pipeline, the polykv pipeline and the lm-eval examples"
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), {})


def test_integrations_page_is_linked():
    root = PAGE.parents[1]
    assert "docs/integrations.md" in (root / "README.md").read_text()
    assert "(integrations.md)" in (root / "docs" / "index.md").read_text()
    for path in re.findall(r"`(examples/[\w./-]+)`", PAGE.read_text()):
        assert os.path.exists(root / path), path
