"""Declared parameters: a type, a range or a set of choices, and a description per parameter.

Retention rules (``RetentionRule.param_specs``) and study tasks (``Task.param_specs``) declare one
:class:`ParamSpec` per parameter; :func:`check_params` checks given values against them, so a plan
or spec with ``"window": -3``, ``"abc"`` or ``1e300`` is refused when it is read, naming the
parameter, instead of failing mid-forward. This module imports nothing from polykv (a bottom module).

>>> spec = ParamSpec(int, low=1, description="observation window")
>>> spec.check("window", 32)
32
>>> spec.check("window", -3)
Traceback (most recent call last):
...
polykv.contract.params.ParamError: parameter 'window' must be >= 1, got -3 (observation window)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class ParamError(ValueError):
    """A parameter value outside its declared type, range or choices; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@attrs.define(frozen=True)
class ParamSpec:
    """One parameter's type, bounds and description.

    ``kind`` is ``int``, ``float`` (ints accepted), ``bool`` or ``str``; ``low``/``high`` are inclusive
    bounds for numbers (None = unbounded); ``choices`` lists the allowed values; ``nullable`` allows
    null (None). Numbers must be finite.
    """

    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v))
    nullable: bool = False
    description: str = ""

    def describe(self) -> str:
        """``an integer in [1, 4096]`` style summary for messages and docs."""
        text = _TYPE_NAMES.get(self.kind, self.kind.__name__)
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.low is not None and self.high is not None:
            text += f" in [{_num(self.low)}, {_num(self.high)}]"
        elif self.low is not None:
            text += f" >= {_num(self.low)}"
        elif self.high is not None:
            text += f" <= {_num(self.high)}"
        return text + (" or null" if self.nullable else "")

    def check(self, name: str, value: Any) -> Any:
        """``value`` when it fits this spec; else a :class:`ParamError` naming ``name``."""
        note = f" ({self.description})" if self.description else ""
        if value is None:
            if self.nullable:
                return None
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got null{note}")
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.kind)
        if not ok:
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r}{note}")
        if self.kind in (int, float):
            if not math.isfinite(value):
                raise ParamError(name, f"parameter '{name}' must be a finite number, got {value!r}{note}")
            if self.low is not None and value < self.low:
                raise ParamError(name, f"parameter '{name}' must be >= {_num(self.low)}, got {value!r}{note}")
            if self.high is not None and value > self.high:
                raise ParamError(name, f"parameter '{name}' must be <= {_num(self.high)}, got {value!r}{note}")
        if self.choices is not None and value not in self.choices:
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r}{note}")
        return value


def check_params(specs: Mapping[str, ParamSpec], values: Mapping[str, Any], *, owner: str = "") -> None:
    """Check every value that has a spec (names without one are left to the caller); raises ParamError."""
    for name, value in values.items():
        spec = specs.get(name)
        if spec is not None:
            try:
                spec.check(name, value)
            except ParamError as exc:
                if owner:
                    raise ParamError(name, f"{owner}: {exc}") from None
                raise


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)
