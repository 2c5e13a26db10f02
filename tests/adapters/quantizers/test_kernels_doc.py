"""docs/kernels.md: its example runs and the pieces it names exist."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "kernels.md"


def test_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(DOC), "exec"), {})


def test_named_files_exist_and_index_links_the_page():
    text = DOC.read_text(encoding="utf-8")
    for path in re.findall(r"`((?:polykv|adapters|bench|tests)/[\w/]+\.py)`", text):
        assert (ROOT / path).is_file(), path
    assert "(kernels.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
