"""How a study item's texts become the token ids the runner feeds: the prompt rule of
:mod:`polykv.runtime.prompt` (BOS, special tokens, plain or chat), with the spec's fields named in its
errors, which are :class:`~polykv.errors.StudyError`.
"""

from __future__ import annotations

import functools

from polykv.errors import StudyError
from polykv.runtime import prompt as rule


class PromptEncoder(rule.PromptEncoder):
    """:class:`polykv.runtime.prompt.PromptEncoder` of a study: its refusals name the spec's fields."""

    error = StudyError
    kind = "field"

    def __init__(self, tokenizer, *, bos="auto", prompt_format: str = "plain", where: str = "study spec"):
        super().__init__(tokenizer, bos=bos, prompt_format=prompt_format, where=where)


def as_encoder(tokenizer) -> PromptEncoder:
    """``tokenizer`` itself when it is a :class:`PromptEncoder`, else the default rule (auto, plain) over it."""
    if isinstance(tokenizer, rule.PromptEncoder):
        return tokenizer
    return _default_encoder(tokenizer)


def _default_encoder(tokenizer) -> PromptEncoder:
    try:
        return _cached_default(tokenizer)
    except TypeError:  # unhashable tokenizer object
        return PromptEncoder(tokenizer)


@functools.lru_cache(maxsize=8)
def _cached_default(tokenizer) -> PromptEncoder:
    return PromptEncoder(tokenizer)
