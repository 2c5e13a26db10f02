"""Bad input to ``polykv report``'s figure and ranking options: one line naming the option, before anything is
written; a figure path holding a file polykv did not write (in any format) is refused, not replaced."""

from __future__ import annotations

import os
from pathlib import Path

from cases import add, write
from cases_files import good_results

OPTIONS = [
    ("format-unknown", ["--format", "gif"], "--format"),
    ("format-one-unknown-of-two", ["--format", "svg,jpeg"], "jpeg"),
    ("format-empty", ["--format", ""], "--format"),
    ("format-only-commas", ["--format", ",,"], "--format"),
    ("dpi-zero", ["--dpi", "0"], "--dpi"),
    ("dpi-negative", ["--dpi", "-72"], "--dpi"),
    ("dpi-huge", ["--dpi", "100000"], "--dpi"),
    ("dpi-not-a-number", ["--dpi", "high"], "--dpi"),
    ("dpi-fraction", ["--dpi", "72.5"], "--dpi"),
    ("placement-metric-unknown", ["--placement-metric", "auc"], "--placement-metric"),
]
for _id, _extra, _expect in OPTIONS:
    add(f"report-{_id}", "cli", lambda d, e=_extra: ["report", good_results(d), "-o", str(d / "rep"), *e], _expect,
        ("rep",))

SVG = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"><text>my own figure</text></svg>\n'
PDF = b"%PDF-1.4\n% my own paper\n%%EOF\n"


def _foreign(name: str, content: bytes, fmt: str):
    def setup(d: Path) -> list[str]:
        write(d, f"figs/{name}", content)
        return ["report", good_results(d), "-o", str(d / "figs"), "--format", fmt]
    return setup


add("report-foreign-svg-figure", "files", _foreign("passkey-score-vs-memory.svg", SVG, "svg"),
    "passkey-score-vs-memory.svg", ("figs/report.md",))
add("report-foreign-pdf-figure", "files", _foreign("passkey-score-vs-memory.pdf", PDF, "png,pdf"),
    "passkey-score-vs-memory.pdf", ("figs/report.md", "figs/passkey-score-vs-memory.png"))
add("report-pdf-figure-is-folder", "files", lambda d: (
    os.makedirs(d / "figs" / "passkey-score-vs-memory.pdf"),
    ["report", good_results(d), "-o", str(d / "figs"), "--format", "pdf"])[-1], "passkey-score-vs-memory.pdf",
    ("figs/report.md",))
add("report-svg-figure-symlink-to-user-file", "files", lambda d: (
    write(d, "thesis.svg", SVG), os.makedirs(d / "figs"),
    os.symlink(d / "thesis.svg", d / "figs" / "passkey-score-vs-memory.svg"),
    ["report", good_results(d), "-o", str(d / "figs"), "--format", "svg"])[-1], "passkey-score-vs-memory.svg",
    ("figs/report.md",))
