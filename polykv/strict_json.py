"""One strict JSON parser and one field reader for every file polykv reads (plans, profiles, study specs).

Plain ``json.loads`` accepts what a careful reader must refuse: ``NaN`` and ``Infinity``, duplicate keys
(the last silently wins), strings holding a lone UTF-16 surrogate (which then cannot be written back as
UTF-8), and nesting deep enough to raise ``RecursionError``. :func:`loads_strict` refuses each of them
with a :class:`JsonInputError` that carries the line and column. :class:`FieldReader` reads one such
file field by field (objects with known keys, typed and ranged values) and raises the file kind's own
error, naming the file, the layer, the dotted field and what to do. Study results lines are checked
by the tables of :mod:`polykv.studies.records`. :func:`check_readable_file` is what every reader checks of a
path before it opens it (a folder, a FIFO or a device is refused, never read).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Callable, Iterable, NoReturn

from polykv.errors import OutputError

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects any polykv file needs (plans and profiles use fewer than 8)."""

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
"""A lone surrogate can only come from one of these: the character itself, or a ``\\uD800``-``\\uDFFF`` escape."""

MAX_DOCUMENT_BYTES = 64 << 20
"""Largest single JSON document (plan, profile, study spec, model config) polykv reads: the largest it
writes is a profile of a few MB; anything past this is not one of its files."""


def check_readable_file(path: str, what: str, *, max_bytes: int | None = None) -> None:
    """Refuse a path that is missing, a folder, a FIFO or device (reading it could block), unreadable, or
    (with ``max_bytes``) larger than any such file can be."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise OutputError(f"{path}: no such file (the {what}); check the path") from None
    except OSError as exc:
        raise OutputError(f"{path}: cannot read the {what} ({exc.strerror}); check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: is a folder, not a {what}; give the file's path")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path}: not a regular file (a pipe, socket or device); give the {what}'s path")
    if max_bytes is not None and st.st_size > max_bytes:
        raise OutputError(f"{path}: {st.st_size:,} bytes is larger than any {what} can be (at most {max_bytes:,}); "
                          f"check the path")


def read_json_head(path: str, limit: int = 1 << 20):
    """The JSON object in a (small) file, or None when it is not one; for ``recognise`` callbacks."""
    if not os.path.isfile(path) or os.path.getsize(path) > limit * 64:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


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
    """Parse ``text`` as strict JSON: no NaN/Infinity, no duplicate keys, no lone surrogates, bounded depth (the
    depth and surrogate scans run only on a text that could fail them)."""
    if text.count("[") + text.count("{") > max_depth:
        _check_depth(text, max_depth)
    try:
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_pairs)
    except json.JSONDecodeError as exc:
        raise JsonInputError(exc.msg, exc.lineno, exc.colno) from None
    except RecursionError:
        raise JsonInputError(f"nested too deeply to read (more than {max_depth} levels)") from None
    if _SURROGATE.search(text):
        _check_strings(value)
    return value


class FieldReader:
    """Typed, strict reading of one parsed JSON file (a plan, a profile, a study spec).

    Every refusal is ``error(message, source=, field=, layer=, hint=)``: the file kind's own error
    (``PlanError``, a profile's or a spec's) naming the file, the layer when there is one, the dotted
    field, and what to do. Objects refuse unknown keys (a misspelt key would otherwise be ignored);
    numbers refuse booleans, NaN and values outside their range.
    """

    def __init__(self, source: str, error: Callable[..., Exception]):
        self.source, self._error = source, error

    def error(self, message: str, *, field: str | None = None, layer: int | None = None,
              hint: str | None = None) -> Exception:
        return self._error(message, source=self.source, field=field or None, layer=layer, hint=hint)

    def fail(self, message: str, *, field: str | None = None, layer: int | None = None,
             hint: str | None = None) -> NoReturn:
        raise self.error(message, field=field, layer=layer, hint=hint)

    def read(self, what: str, *, missing_hint: str, text_hint: str) -> Any:
        """The parsed JSON of the file ``source`` (a ``what``, e.g. "plan file"), every failure one error."""
        try:
            check_readable_file(self.source, what, max_bytes=MAX_DOCUMENT_BYTES)
            with open(self.source, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            self.fail("no such file", hint=missing_hint)
        except OutputError as exc:  # its text starts with the path, which the error names anyway
            self.fail(str(exc).split(": ", 1)[-1])
        except UnicodeDecodeError:
            self.fail("not a UTF-8 text file", hint=text_hint)
        except OSError as exc:
            self.fail(f"cannot read the file ({exc.strerror})", hint="check the path and its permissions")
        return self.parse(text)

    def parse(self, text: str) -> Any:
        try:
            return loads_strict(text)
        except JsonInputError as exc:
            if exc.line:
                self.fail(f"malformed JSON at line {exc.line}, column {exc.column}: {exc.message}",
                          hint="fix the JSON syntax (a linter such as `python -m json.tool FILE` shows it)")
            self.fail(f"malformed JSON: {exc.message}")

    def obj(self, value: Any, field: str, required: Iterable[str] = (), optional: Iterable[str] = (), *,
            layer: int | None = None) -> dict:
        """``value`` as an object whose keys are all in ``required`` or ``optional``, every required one given."""
        if not isinstance(value, dict):
            self.fail(f"expected a JSON object, got {_kind(value)}", field=field, layer=layer)
        required = list(required)
        allowed = set(required) | set(optional)
        unknown = sorted(set(value) - allowed)
        if unknown:
            self.fail(f"unknown key(s) {unknown}", field=join(field, unknown[0]), layer=layer,
                      hint=f"allowed keys here: {sorted(allowed)}")
        for key in required:
            if key not in value:
                self.fail("missing required key", field=join(field, key), layer=layer)
        return value

    def int_(self, value: Any, field: str, *, layer: int | None = None, minimum: int | None = None,
             maximum: float | None = None, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"expected an integer, got {value!r}", field=field, layer=layer)
        self._range(value, field, layer, minimum, maximum)
        return value

    def float_(self, value: Any, field: str, *, layer: int | None = None, minimum: float | None = None,
               maximum: float | None = None, optional: bool = False) -> float | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"expected a finite number, got {value!r}", field=field, layer=layer)
        self._range(value, field, layer, minimum, maximum)
        return float(value)

    def _range(self, value, field: str, layer: int | None, minimum, maximum) -> None:
        if minimum is not None and value < minimum:
            self.fail(f"must be >= {minimum}, got {value}", field=field, layer=layer)
        if maximum is not None and value > maximum:
            self.fail(f"must be <= {maximum:g}, got {value:g}", field=field, layer=layer,
                      hint="no real file holds a value this large; fix the number")

    def str_(self, value: Any, field: str, *, layer: int | None = None, optional: bool = False,
             nonempty: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or (nonempty and not value):
            self.fail(f"expected a{' non-empty' if nonempty else ''} string, got {value!r}", field=field, layer=layer)
        return value

    def bool_(self, value: Any, field: str, *, layer: int | None = None) -> bool:
        if not isinstance(value, bool):
            self.fail(f"expected true or false, got {value!r}", field=field, layer=layer)
        return value

    def dict_(self, value: Any, field: str, *, layer: int | None = None, optional: bool = False) -> dict | None:
        """Any JSON object (keys are the caller's to check), e.g. a plugin's parameters."""
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            self.fail(f"expected a JSON object, got {value!r}", field=field, layer=layer)
        return value

    def list_(self, value: Any, field: str, *, layer: int | None = None, nonempty: bool = False,
              what: str = "a list", hint: str | None = None) -> list:
        if not isinstance(value, list) or (nonempty and not value):
            got = repr(value) if isinstance(value, list) else _kind(value)
            self.fail(f"expected {what}, got {got}", field=field, layer=layer, hint=hint)
        return value

    def choice(self, value: Any, field: str, choices: Iterable[Any], what: str, *, layer: int | None = None,
               hint: str | None = None) -> Any:
        """``value`` when it is one of ``choices`` (compared with its type: ``1`` is not ``true``)."""
        choices = tuple(choices)
        if not any(type(value) is type(c) and value == c for c in choices):
            self.fail(f"unknown {what} {value!r}; use " + " or ".join(json.dumps(c) for c in choices), field=field,
                      layer=layer, hint=hint)
        return value


def join(field: str, key: str) -> str:
    """The dotted name of ``key`` inside ``field`` (``key`` alone at the top level)."""
    return f"{field}.{key}" if field else key


def _kind(value: Any) -> str:
    return type(value).__name__
