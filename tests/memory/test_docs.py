"""docs/memory.md's examples run and state the numbers the code computes."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_code_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
    assert "total" in capsys.readouterr().out


def test_documents_every_metadata_entry_and_phase():
    text = DOC.read_text(encoding="utf-8")
    for word in ("`positions`", "`accumulated`", "`query_window`", '`"prefill"`', '`"decode"`', "1,835,008,000"):
        assert word in text
