"""Declared parameters: a type, a range or a set of choices, a default and a description per parameter.

Retention rules, quantizers and allocators (``param_specs``, through :class:`DeclaredParams`) and
study tasks (``Task.param_specs``) declare one :class:`ParamSpec` per parameter; :func:`check_params`
checks given values against them, so a plan or spec with ``"window": -3``, ``"abc"`` or ``1e300`` is
refused when it is read, naming the parameter, instead of failing mid-forward. A plugin's spec carries
the parameter's default, so a parameter is declared once; the older ``defaults`` mapping still works
(each is derived from the other, see :class:`DeclaredParams`). This module imports nothing from polykv
(a bottom module).

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
from typing import Any, ClassVar, Mapping

import attrs

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()
"""The ``default`` of a :class:`ParamSpec` that declares none."""


class UncheckedParamsWarning(UserWarning):
    """A plan gives a plugin parameters it declares no :class:`ParamSpec` for: checked only when it runs."""


class ParamError(ValueError):
    """A parameter value outside its declared type, range or choices; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@attrs.define(frozen=True)
class ParamSpec:
    """One parameter's type, bounds and description.

    ``kind`` is ``int``, ``float`` (ints accepted), ``bool``, ``str``, ``dict`` or ``list``; ``low``/``high``
    are inclusive bounds for numbers (None = unbounded); ``choices`` lists the allowed values;
    ``nullable`` allows null (None); ``default`` is the value a plugin uses when a plan gives none.
    Numbers must be finite. A ``list`` with ``items`` (``int`` or ``float``) holds numbers of that kind,
    each within ``low``/``high``, and at least ``min_items`` of them.
    """

    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v))
    nullable: bool = False
    description: str = ""
    default: Any = NO_DEFAULT
    odd: bool = False
    """Integers only: the value must be odd (a centred pooling kernel)."""
    items: type | None = None
    """Lists only: the kind of every item (``int`` or ``float``); ``low``/``high`` then bound each item."""
    min_items: int = 0
    """Lists only: the fewest items the list may hold (1: an empty list is refused)."""
    token_ids: bool = False
    """Lists of ``int`` only: the items are token ids of the model's vocabulary, which ``polykv.apply`` checks
    them against (``[0, vocab_size)``) when it knows the model."""

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT

    def describe(self) -> str:
        """``an integer in [1, 4096]`` style summary for messages and docs."""
        text = _TYPE_NAMES.get(self.kind, self.kind.__name__)
        if self.items is not None:
            return self._describe_list()
        if self.odd:
            text = "an odd integer"
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text += self._describe_range()
        return text + (" or null" if self.nullable else "")

    def _describe_range(self) -> str:
        if self.low is not None and self.high is not None:
            return f" in [{_num(self.low)}, {_num(self.high)}]"
        if self.low is not None:
            return f" >= {_num(self.low)}"
        if self.high is not None:
            return f" <= {_num(self.high)}"
        return ""

    def _describe_list(self) -> str:
        what = "token ids" if self.token_ids else ("integers" if self.items is int else "numbers")
        text = (f"a list of {what}" if self.min_items < 1 else
                f"a non-empty list of {what}" if self.min_items == 1 else f"a list of at least {self.min_items} {what}")
        return text + self._describe_range() + (" or null" if self.nullable else "")

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
        if self.items is not None:
            return self._check_items(name, value, note)
        if self.kind in (int, float):
            if not math.isfinite(value):
                raise ParamError(name, f"parameter '{name}' must be a finite number, got {value!r}{note}")
            if self.low is not None and value < self.low:
                raise ParamError(name, f"parameter '{name}' must be >= {_num(self.low)}, got {value!r}{note}")
            if self.high is not None and value > self.high:
                raise ParamError(name, f"parameter '{name}' must be <= {_num(self.high)}, got {value!r}{note}")
        if self.odd and value % 2 == 0:
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r}{note}")
        if self.choices is not None and value not in self.choices:
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r}{note}")
        return value


    def _check_items(self, name: str, value: list, note: str) -> list:
        """A list of ``items`` numbers within ``low``/``high``, at least ``min_items`` long."""
        if len(value) < self.min_items:
            raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r}{note}")
        for i, item in enumerate(value):
            ok = (isinstance(item, (int, float)) if self.items is float else isinstance(item, int)) \
                and not isinstance(item, bool) and math.isfinite(item) \
                and (self.low is None or item >= self.low) and (self.high is None or item <= self.high)
            if not ok:
                raise ParamError(name, f"parameter '{name}' must be {self.describe()}, got {value!r} (item {i} is "
                                       f"{item!r}){note}")
        return value


def token_id_params(specs: Mapping[str, ParamSpec]) -> list[str]:
    """Names of the parameters whose spec holds token ids (checked against a model's vocabulary)."""
    return sorted(n for n, s in specs.items() if s.token_ids)


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


def with_defaults(specs: Mapping[str, ParamSpec], **defaults: Any) -> dict[str, ParamSpec]:
    """``specs`` with new defaults for some parameters (a subclass changing its parent's defaults)."""
    unknown = sorted(set(defaults) - set(specs))
    if unknown:
        raise TypeError(f"with_defaults: no spec for parameter(s) {unknown}; known: {sorted(specs)}")
    return {n: attrs.evolve(s, default=defaults[n]) if n in defaults else s for n, s in specs.items()}


class DeclaredParams:
    """Parameters of a plugin class (rule, quantizer, allocator), declared once.

    A subclass declares ``param_specs`` (name -> :class:`ParamSpec` with its ``default``); the
    ``defaults`` mapping is derived from it. A class that declares ``defaults`` itself (the older
    form, kept for third-party plugins) keeps them: its specs, own or inherited, take their defaults
    from that mapping, and names without a spec are not checked (plan validation warns about them,
    :func:`unchecked_params`). Building an instance refuses unknown names and values outside their
    specs, with a :class:`ParamError` naming the plugin and the parameter.
    """

    plugin_kind: ClassVar[str] = "plugin"
    """``"rule"``, ``"quantizer"`` or ``"allocator"``: the word error messages use."""
    defaults: ClassVar[Mapping[str, Any]] = {}
    """Parameter name -> default (derived from ``param_specs`` when the class declares only those)."""
    param_specs: ClassVar[Mapping[str, ParamSpec]] = {}
    """Parameter name -> :class:`ParamSpec` (type, range or choices, default); values are checked."""

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        specs = dict(cls.param_specs)
        if "param_specs" in own and "defaults" not in own:
            missing = sorted(n for n, s in specs.items() if not s.has_default and n not in cls.defaults)
            if missing:
                raise TypeError(f"{cls.__qualname__}: parameter(s) {missing} declare no default; give "
                                "ParamSpec(..., default=VALUE)")
            cls.defaults = {**cls.defaults, **{n: s.default for n, s in specs.items() if s.has_default}}
        defaults = cls.defaults
        cls.param_specs = {n: attrs.evolve(s, default=defaults[n]) if n in defaults and (
            not s.has_default or s.default is not defaults[n]) else s for n, s in specs.items()}

    def __init__(self, **params: Any):
        self.params = resolve_params(type(self), params)


def resolve_params(cls: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """``cls.defaults`` updated with ``params``, refusing unknown names and values outside their specs."""
    owner = f"{getattr(cls, 'plugin_kind', 'plugin')} '{getattr(cls, 'name', cls.__name__)}'"
    unknown = sorted(set(params) - set(cls.defaults))
    if unknown:
        raise ValueError(f"{owner} has no parameter(s) {unknown}; known: {sorted(cls.defaults)}")
    check_params(cls.param_specs, params, owner=owner)
    return {**cls.defaults, **params}


def unchecked_params(cls: Any, params: Mapping[str, Any]) -> list[str]:
    """Names in ``params`` that ``cls`` knows but declares no :class:`ParamSpec` for (their values go unchecked)."""
    specs = getattr(cls, "param_specs", {}) or {}
    return sorted(n for n in params if n not in specs)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)
