"""Per-model data a retention rule needs, declared by the rule itself.

Some rules score keys with data measured once per model (TriAttention: pre-RoPE query statistics per
layer and query head). Such a rule class sets the class attribute ``model_data_need`` to a
:class:`ModelDataNeed`: the key it reads from ``ctx.model_data``, how to compute the data over plain
token batches, how to load a saved copy (the data object saves itself with ``data.save(path)``), an
optional check that a loaded copy belongs to the model, and the side file beside a profile where
calibration saves it (``x.profile.json`` -> ``x`` + ``suffix``).

Calibration, studies and :func:`polykv.profiling.calibrate.model_data_for` ask the registry for the
needs of the rules they run (:func:`needs_of_rules`, :func:`registered_needs`), so no core module names
a rule. Users keep passing ``model_data={key: data}`` to :func:`polykv.apply` directly.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import attrs

NEED_ATTRIBUTE = "model_data_need"
"""The rule class attribute that holds a :class:`ModelDataNeed` (absent or None: the rule needs nothing)."""


@attrs.define(frozen=True, kw_only=True)
class ModelDataNeed:
    """What a rule needs measured on the model, and where that lives beside a profile."""

    key: str
    """Key of ``ctx.model_data`` (and of ``model_data=`` in :func:`polykv.apply`) the rule reads."""
    suffix: str
    """Side-file suffix: a profile ``x.profile.json`` keeps the data in ``x`` + suffix."""
    compute: Callable[[Any, list], Any]
    """``compute(model, token_batches)`` -> the data (token batches: LongTensor [1, T] of plain text)."""
    load: Callable[[str], Any]
    """``load(path)`` -> the data saved there with ``data.save(path)``."""
    check: Callable[[Any, Any], None] | None = None
    """``check(data, model)`` raises when loaded data was measured on another model."""
    description: str = ""
    """What the data is, for messages (e.g. ``"query statistics"``)."""


def need_of(rule_class: Any) -> ModelDataNeed | None:
    """The rule class's declared need, or None."""
    need = getattr(rule_class, NEED_ATTRIBUTE, None)
    if need is not None and not isinstance(need, ModelDataNeed):
        raise TypeError(f"{getattr(rule_class, '__name__', rule_class)!r}.{NEED_ATTRIBUTE} must be a "
                        f"polykv.contract.model_data.ModelDataNeed or None, got {type(need).__name__}")
    return need


def needs_of_rules(registry: Any, rules: Iterable[str]) -> list[ModelDataNeed]:
    """The distinct needs (by key, first rule first) of the registered rules among ``rules``."""
    out: dict[str, ModelDataNeed] = {}
    for rule in rules:
        if not registry.has("operator", rule):
            continue  # an unknown rule is reported where the plan or settings are checked
        need = need_of(registry.operator(rule))
        if need is not None:
            out.setdefault(need.key, need)
    return list(out.values())


def registered_needs(registry: Any) -> list[ModelDataNeed]:
    """The distinct needs of every registered rule."""
    return needs_of_rules(registry, registry.names("operator"))


def side_file(profile_path: str, suffix: str) -> str:
    """Where a profile's side file with ``suffix`` lives: ``x.profile.json`` -> ``x`` + ``suffix``."""
    base = str(profile_path)
    for ext in (".profile.json", ".json"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base + suffix


def load_side_files(profile_path: str, needs: Iterable[ModelDataNeed], *, model: Any = None) -> dict[str, Any]:
    """``{key: data}`` for each need whose side file exists beside ``profile_path`` (checked against
    ``model`` when one is given and the need has a check)."""
    out = {}
    for need in needs:
        path = side_file(profile_path, need.suffix)
        if os.path.isfile(path):
            data = need.load(path)
            if model is not None and need.check is not None:
                need.check(data, model)
            out[need.key] = data
    return out
