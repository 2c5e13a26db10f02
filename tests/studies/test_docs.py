"""Every Python example in docs/studies.md and docs/tasks.md runs and its assertions hold."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples():
    for name in ("studies.md", "tasks.md"):
        text = (DOCS / name).read_text()
        for i, code in enumerate(BLOCK.findall(text)):
            yield pytest.param(code, id=f"{name}-{i}")


def test_docs_have_examples():
    assert len(list(examples())) >= 6


@pytest.mark.parametrize("code", list(examples()))
def test_doc_example_runs(code):
    exec(compile(code, "<doc example>", "exec"), {"__name__": "doc_example"})
