"""One strict JSON parser for every file polykv reads (plans, profiles, study specs, results lines).

Plain ``json.loads`` accepts what a careful reader must refuse: ``NaN`` and ``Infinity``, duplicate keys
(the last silently wins), strings holding a lone UTF-16 surrogate (which then cannot be written back as
UTF-8), and nesting deep enough to raise ``RecursionError``. :func:`loads_strict` refuses each of them
with a :class:`JsonInputError` that carries the line and column; every file reader wraps it in its own
error type naming the file.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects any polykv file needs (plans and profiles use fewer than 8)."""

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


class JsonInputError(ValueError):
    """Text that is not strict JSON; ``line`` and ``column`` are 1-based (0 when unknown)."""

    def __init__(self, message: str, line: int = 0, column: int = 0):
        self.message, self.line, self.column = message, line, column
        where = f"line {line}, column {column}: " if line else ""
        super().__init__(where + message)


def _position(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _check_depth(text: str, max_depth: int) -> None:
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > max_depth:
                line, col = _position(text, match.start())
                raise JsonInputError(f"nested deeper than {max_depth} levels; no polykv file nests like this",
                                     line, col)
        elif token in "]}":
            depth -= 1


def _no_constant(name: str):
    raise JsonInputError(f"{name} is not a number JSON allows (write a finite number)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonInputError(f"key {key!r} appears twice in one object (keep one)")
        out[key] = value
    return out


def _check_strings(value: Any, path: str = "") -> None:
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JsonInputError(f"the string at {where or 'the top level'} holds a lone surrogate "
                                     "(\\ud800-\\udfff); write valid Unicode") from None
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str):
                    stack.append((key, f"{where}.{key}" if where else key))
                stack.append((sub, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(item))


def loads_strict(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``text`` as strict JSON: no NaN/Infinity, no duplicate keys, no lone surrogates, bounded depth."""
    _check_depth(text, max_depth)
    try:
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_pairs)
    except json.JSONDecodeError as exc:
        raise JsonInputError(exc.msg, exc.lineno, exc.colno) from None
    except RecursionError:
        raise JsonInputError(f"nested too deeply to read (more than {max_depth} levels)") from None
    _check_strings(value)
    return value
