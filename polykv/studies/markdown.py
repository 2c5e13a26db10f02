"""Names from a results file made safe to print in a Markdown report.

Policy, study, task, plan and design names come from results files, which an older polykv or a person may have
written: a name may hold ``|`` (which splits a table cell), a newline (which ends a table row or heading), a
backtick (which ends a code span) or HTML (``<img src=x onerror=...>``, which a Markdown viewer renders). Every
name the report prints goes through one of these:

- :func:`cell`: plain text (table cells, alt text): HTML escaped, Markdown punctuation backslash-escaped;
- :func:`code`: an inline code span, whose content Markdown shows literally (HTML included);
- :func:`line`: a sentence that already holds code spans (a warning from :mod:`polykv.studies.designs`): HTML
  escaped, so a broken code span shows its text instead of rendering it.

In all three a control character (newline, tab, escape, NUL, a line separator) is shown as its escape (``\\n``),
so every name stays on its line.
"""

from __future__ import annotations

import html
import re
import unicodedata
from typing import Any

_MARKDOWN = re.compile(r"([\\`*\[\]|~$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
"""Characters that start Markdown formatting inside a line (``_`` only where it is not inside a word)."""


def visible(value: Any) -> str:
    """``str(value)`` with every control character (and line or paragraph separator) as its escape."""
    text = str(value)
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in text)


def cell(value: Any) -> str:
    """``value`` as plain Markdown text: one line, no HTML, no formatting, no table cell split."""
    return _MARKDOWN.sub(r"\\\1", html.escape(visible(value), quote=False))


def code(value: Any) -> str:
    """``value`` as one inline code span, fenced by more backticks than it holds in a row (outside tables: a
    table splits cells at ``|`` even inside a code span, so cells use :func:`cell`)."""
    text = visible(value)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def line(text: str) -> str:
    """A sentence built elsewhere (it may hold code spans around names): one line, no HTML."""
    return html.escape(visible(text), quote=False)
