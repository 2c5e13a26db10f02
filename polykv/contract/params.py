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
from types import MappingProxyType
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


_SPEC_KEY = "polykv_param"
"""Key of an :func:`param` field's attrs metadata holding its :class:`ParamSpec`."""

_KINDS = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "list": list}


def param(default: Any, *, low: float | None = None, high: float | None = None, choices: Any = None,
          description: str = "", odd: bool = False, min_items: int = 0, token_ids: bool = False) -> Any:
    """A plugin parameter, declared as a typed field of its class::

        class SnapKV(ScoredRule):
            window: int = param(32, low=1, description="observation window")

    The annotation gives the type (``int``, ``float``, ``bool``, ``str``, ``dict``, ``list`` or ``list[int]`` /
    ``list[float]``, ``| None`` for a nullable one); ``default`` is the value a plan that gives none gets; ``low`` /
    ``high`` (inclusive), ``choices``, ``odd``, ``min_items`` and ``token_ids`` bound it as in :class:`ParamSpec`.
    A plan's value is checked when the plugin is built (``Rule(window=-3)`` is a :class:`ParamError` naming
    ``window``); the rule reads it as ``self.window``. A subclass changes an inherited parameter's default by
    assigning it (``window = 8``).
    """
    spec = ParamSpec(object, low=low, high=high, choices=choices, description=description, default=default, odd=odd,
                     min_items=min_items, token_ids=token_ids)
    return attrs.field(default=default, metadata={_SPEC_KEY: spec})


def _spec_of_field(owner: str, name: str, spec: ParamSpec, annotation: Any) -> ParamSpec:
    """``spec`` with the kind, items and nullability the field's annotation declares."""
    text = annotation if isinstance(annotation, str) else (
        annotation.__name__ if isinstance(annotation, type) else repr(annotation))
    parts = [p.strip() for p in text.split("|")]
    nullable = "None" in parts
    parts = [p for p in parts if p != "None"]
    kind = items = None
    if len(parts) == 1 and parts[0].startswith("list[") and parts[0].endswith("]"):
        items = _KINDS.get(parts[0][5:-1])
        kind = list if items in (int, float) else None
    elif len(parts) == 1:
        kind = _KINDS.get(parts[0])
    if kind is None:
        raise TypeError(f"{owner}: parameter {name!r} is annotated {text!r}; annotate it with int, float, bool, str, "
                        "dict, list, list[int] or list[float] (add '| None' to allow null)")
    return attrs.evolve(spec, kind=kind, items=items, nullable=nullable)


def _check_default(owner: str, name: str, spec: ParamSpec) -> None:
    """A field's default must fit its own declaration (a plan that gives none gets it): TypeError naming both."""
    try:
        spec.check(name, spec.default)
    except ParamError as exc:
        raise TypeError(f"{owner}: the default of {exc}; fix the default or the declaration") from None


class DeclaredParams:
    """Parameters of a plugin class (rule, quantizer, allocator), declared once.

    A subclass declares each parameter as a typed field (:func:`param`); the class attributes ``param_specs``
    (name -> :class:`ParamSpec`) and ``defaults`` (name -> default) are derived from them, and the class
    becomes an attrs class (``attrs.fields(cls)`` lists the parameters; ``repr`` shows their values). Building
    an instance (``cls(**params)``, as plan validation and the runtime do) refuses unknown names and values
    outside their specs with a :class:`ParamError` naming the plugin and the parameter, sets each parameter as
    an attribute, then calls ``__attrs_post_init__`` (checks across parameters) when the class has one.
    ``params`` is a read-only mapping of every parameter's value.

    The 0.1 form (``param_specs = {...}`` of :class:`ParamSpec` with defaults, or a bare ``defaults`` mapping, read
    as ``self.params[...]``) still works for third-party plugins; names without a spec are not checked (plan
    validation warns about them, :func:`unchecked_params`).
    """

    plugin_kind: ClassVar[str] = "plugin"
    """``"rule"``, ``"quantizer"`` or ``"allocator"``: the word error messages use."""
    defaults: ClassVar[Mapping[str, Any]] = {}
    """Parameter name -> default (derived from the fields, or from ``param_specs``)."""
    param_specs: ClassVar[Mapping[str, ParamSpec]] = {}
    """Parameter name -> :class:`ParamSpec` (type, range or choices, default); values are checked."""
    _field_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        owner = f"{getattr(cls, 'plugin_kind', 'plugin')} {cls.__qualname__}"
        fields = {n: v for n, v in own.items() if isinstance(v, type(attrs.field()))}
        if fields and ("param_specs" in own or "defaults" in own):
            raise TypeError(f"{owner}: declare parameters either as fields (param(...)) or in param_specs/defaults, not both")
        specs = dict(cls.param_specs)
        if fields:
            notes = getattr(cls, "__annotations__", {}) if "__annotations__" in own else {}
            for name, field in fields.items():
                spec = field.metadata.get(_SPEC_KEY)
                if spec is None or name not in notes:
                    raise TypeError(f"{owner}: field {name!r} must be a typed param(...), e.g. "
                                    f"{name}: int = param(DEFAULT, ...)")
                specs[name] = _spec_of_field(owner, name, spec, notes[name])
                _check_default(owner, name, specs[name])
                delattr(cls, name)
        overrides = [n for n in cls._field_names if n in own and n not in fields]
        for name in overrides:             # an inherited field given a new default: ``window = 8``
            specs[name] = attrs.evolve(specs[name], default=own[name])
            _check_default(owner, name, specs[name])
            delattr(cls, name)
        if fields or overrides:
            cls._field_names = tuple(dict.fromkeys((*cls._field_names, *fields)))
            cls.param_specs = specs
            cls.defaults = {n: specs[n].default for n in cls._field_names}
            attrs.define(cls, these={n: attrs.field(default=specs[n].default) for n in cls._field_names},
                         init=False, eq=False, slots=False, repr=True)
            return
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
        values = resolve_params(type(self), params)
        for name in self._field_names:
            object.__setattr__(self, name, values[name])
        self._other_params = {n: v for n, v in values.items() if n not in self._field_names}
        post = getattr(self, "__attrs_post_init__", None)
        if post is not None:
            post()

    @property
    def params(self) -> Mapping[str, Any]:
        """Every parameter's value (read-only)."""
        return MappingProxyType({**self._other_params, **{n: getattr(self, n) for n in self._field_names}})


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
