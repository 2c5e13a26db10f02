"""What a rule (or a core feature such as a plan's ranks) needs measured on a model: :class:`ModelDataNeed`.

It sits with the models because the data is the model's (computed from it, checked against it, kept beside its
profile); the plugin contract offers it to rules (:mod:`polykv.contract.model_data`), which also finds, loads,
checks and writes such data generically.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs


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
    recognise: Callable[[str], bool] | None = None
    """``recognise(path)``: True when the file at ``path`` is this data as polykv writes it (a command then
    replaces it); None: a file is recognised when :attr:`load` reads it."""
    description: str = ""
    """What the data is, for messages (e.g. ``"query statistics"``)."""
    takes_tokenizer: bool = False
    """True: ``compute`` also takes ``tokenizer=`` (the tokenizer the data is computed with, e.g. to build the
    token ids of a probe's prompts); called without it, the need finds the model's own or refuses."""
