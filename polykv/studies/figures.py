"""The figures of one report: their file names, formats and resolution, checked before any is drawn."""

from __future__ import annotations

import os
import re
from typing import Callable, Sequence

import matplotlib

from polykv.atomic import check_output
from polykv.studies import plots
from polykv.studies.options import DEFAULT_DPI, check_dpi, parse_formats


class Figures:
    """The figures of one report, drawn only once every path is known to be safe to write.

    File names come from task names and budgets read from the results file: every character but letters,
    digits, ``_``, ``-`` and ``.`` becomes ``_`` and leading ``.``, ``_`` and ``-`` go, so every figure stays inside the
    report folder (a task named ``../../x`` draws ``x-score-vs-memory.png`` there); two names that end up
    equal get ``-2``, ``-3``, ... . Each figure is written once per format; the report embeds the PNG (the first
    format when PNG is not asked for).
    """

    def __init__(self, out_dir: str, formats: Sequence[str] = ("png",), dpi: int = DEFAULT_DPI):
        self.out_dir = out_dir
        self.formats = parse_formats(formats)
        self.dpi = check_dpi(dpi)
        self.pending: list[tuple[str, Callable[[str], str]]] = []

    def add(self, stem: str, draw: Callable[[str], str]) -> str:
        """Reserve file names for ``draw(path)``, one per format; returns the embedded one (relative to the
        report folder)."""
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).lstrip("._-") or "figure"
        taken = {os.path.splitext(os.path.basename(p))[0] for p, _ in self.pending}
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        for fmt in self.formats:
            self.pending.append((os.path.join(self.out_dir, f"{name}.{fmt}"), draw))
        shown = "png" if "png" in self.formats else self.formats[0]
        return f"{name}.{shown}"

    def check(self, option: str, inputs) -> None:
        """Refuse (before anything is drawn) a figure path holding a file polykv did not write."""
        for path, _ in self.pending:
            check_output(path, what="report figure", option=option, recognise=plots.is_report_figure,
                         inputs=inputs)

    def draw(self) -> list[str]:
        """Draw every figure (each file written atomically); the paths written."""
        with matplotlib.rc_context({"savefig.dpi": self.dpi}):
            return [draw(path) for path, draw in self.pending]
