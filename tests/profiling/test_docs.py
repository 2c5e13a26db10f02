"""docs/calibration.md: its Python examples run, every CLI option is documented, and the report helpers
summarise a profile the way the page shows."""

from __future__ import annotations

import argparse
import pathlib
import re

import numpy as np

from polykv.commands import calibrate as command
from polykv.profiling.calib_report import operation_rows, operation_table_markdown, validation_markdown
from polykv.profiling.calibrate import calibrate

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "calibration.md"


def test_code_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})


def test_every_cli_option_is_documented():
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["calibrate"]
    text = DOC.read_text(encoding="utf-8")
    options = [s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(options) >= 15
    for opt in options:
        assert opt in text, f"docs/calibration.md does not mention {opt}"


def test_operation_table_spreads(model, sequences, small_settings):
    prof = calibrate(model, sequences(2), small_settings(rules=("tova",), keeps=(0.5, 1.0))).profile
    rows = dict((name, (lo, hi, ratio)) for name, lo, hi, ratio in operation_rows(prof))
    assert sorted(rows) == ["K 4 bits", "K 8 bits", "V 4 bits", "V 8 bits", "tova keep 0.5"]
    col = next(i for i, c in enumerate(prof.configs) if c.rule == "tova" and c.k_bits == c.v_bits == 16)
    lo, hi, ratio = rows["tova keep 0.5"]
    assert (lo, hi) == (prof.table()[:, col].min(), prof.table()[:, col].max())
    assert np.isclose(ratio, hi / lo) and ratio >= 1
    assert "| tova keep 0.5 |" in operation_table_markdown(prof)
    assert "no KL validation" in validation_markdown(prof)
