"""The study task contract: a task makes items, and scores a generation against an item.

Every item separates the ``context`` (prefilled, then compressed by the plan) from the ``question``
(fed through the compressed cache afterwards) and the ``answers``. Scoring the first answer token with
the full cache would flatter a method, so the two are never merged (DESIGN.md, evaluation protocol).

A tokenizer here is anything with ``encode(text, add_special_tokens=False) -> list[int]``: a Hugging
Face tokenizer, the offline :class:`WhitespaceTokenizer` / :class:`CharTokenizer` below, or the
runner's :class:`~polykv.studies.prompt.PromptEncoder` (a tokenizer with the study's ``bos`` and
``prompt_format``). Prompt lengths (:func:`prompt_length`, the ``length`` of every needle task) count
exactly the tokens the runner feeds: the tokens the tokenizer puts in front of the context (its BOS,
where it adds one), the context and the question tokenized separately, and with ``prompt_format``
"chat" the template around them. A plain tokenizer counts with the default rule (``bos`` "auto",
plain completion).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs

from polykv.contract.params import ParamError, check_params
from polykv.errors import StudyError
from polykv.models.corpus import filler_text
from polykv.studies.prompt import as_encoder
from polykv.studies.tasks import metrics

GENERATE = "generate"
TEACHER_FORCED = "teacher_forced"


@attrs.define(frozen=True, kw_only=True)
class TaskItem:
    """One evaluation item."""

    task: str
    """Name of the task that made (or loaded) the item."""
    id: str
    """Stable identifier, unique within the task and seed."""
    context: str
    """Text prefilled and compressed by the plan."""
    question: str
    """Text fed through the compressed cache after the context (may be empty for continuation)."""
    answers: tuple[str, ...]
    """Accepted answers (or, for continuation fidelity, the reference continuation)."""
    metric: str
    """Name of the scoring function in :data:`polykv.studies.tasks.metrics.METRICS`."""
    max_new_tokens: int
    """Tokens to generate for this item (0 for teacher-forced items)."""
    meta: Mapping[str, Any] = attrs.field(factory=dict)
    """Task-specific facts (depth, key, token counts, source file and line, ...)."""


class Task:
    """Base class of study tasks; subclasses set ``name``, ``defaults`` and implement :meth:`make_item`.

    ``mode`` is ``"generate"`` (greedy generation scored by :meth:`score`) or ``"teacher_forced"``
    (the runner feeds ``answers[0]`` and computes KL / top-1 agreement against the full cache and
    perplexity).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    mode: ClassVar[str] = GENERATE
    defaults: ClassVar[Mapping[str, Any]] = {}
    param_specs: ClassVar[Mapping[str, Any]] = {}
    """Parameter name -> :class:`polykv.contract.params.ParamSpec`; values are checked before any model loads."""

    def params(self, **overrides) -> dict[str, Any]:
        """The task's defaults updated with ``overrides``; an unknown parameter or a value outside its
        declared type or range is an error."""
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise StudyError(f"task '{self.name}' has no parameter(s) {unknown}; its parameters are "
                             f"{dict(self.defaults)}")
        try:
            check_params(self.param_specs, overrides, owner=f"task '{self.name}'")
        except ParamError as exc:
            raise param_error(exc.param, str(exc)) from None
        merged = {**self.defaults, **overrides}
        self.check_params(merged)
        return merged

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Checks across parameters (each one's own type and range are in ``param_specs``); raise a
        :func:`param_error` naming the parameter to fix."""

    def make_items(self, tokenizer, n: int, seed: int = 0, **params) -> list[TaskItem]:
        """``n`` items, deterministic in ``seed`` (item i is independent of n)."""
        if n < 0:
            raise StudyError(f"task '{self.name}': n must be >= 0; got {n}")
        p = self.params(**params)
        return [self.make_item(tokenizer, i, random.Random(f"{self.name}:{seed}:{i}"), p) for i in range(n)]

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        raise NotImplementedError

    def score(self, item: TaskItem, generated_text: str) -> float:
        """Score in [0, 1] of ``generated_text`` for ``item`` with the item's own metric; an item whose
        ``meta["stop"]`` lists stop strings is scored on its :func:`answer_span` only."""
        stop = item.meta.get("stop")
        if stop is not None:
            generated_text = answer_span(generated_text, stop)
        return metrics.score(item.metric, generated_text, item)


def param_error(param: str, message: str) -> StudyError:
    """A :class:`StudyError` about the task parameter ``param``; its ``param`` attribute lets a study spec
    name the field (``tasks[i].params.<param>``)."""
    err = StudyError(message)
    err.param = param
    return err


def answer_span(text: str, stop: Sequence[str]) -> str:
    """The answer part of a generation: leading whitespace dropped, then everything before the first stop
    string (``("\\n",)``: the first line). A model that goes on to repeat the context past its answer is
    scored on the answer alone."""
    text = text.lstrip()
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


# -- offline tokenizers ---------------------------------------------------------------------------
class WhitespaceTokenizer:
    """A model-free tokenizer: one token per whitespace-separated word (ids from a growing vocabulary)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


class CharTokenizer:
    """A model-free tokenizer: one token per character (its code point)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def count_tokens(tokenizer, text: str) -> int:
    """Number of tokens of ``text`` without special tokens; empty text has 0."""
    if not text:
        return 0
    return len(tokenizer.encode(text, add_special_tokens=False))


def prompt_length(tokenizer, context: str, question: str) -> int:
    """Tokens the runner feeds for ``context`` then ``question``: special tokens in front of the context
    (the BOS, where the prompt rule places one) and, for chat prompts, the template included."""
    return as_encoder(tokenizer).prompt_length(context, question)


# -- haystack building ----------------------------------------------------------------------------
def text_units(text: str) -> list[str]:
    """``text`` as words with their trailing whitespace (joining the units gives back the stripped text)."""
    return re.findall(r"\S+\s*", text.strip())


def filler_units(tokenizer, tokens: int, *, kind: str, seed: int) -> list[str]:
    """Real filler text (see :func:`polykv.models.corpus.filler_text`) of at least ``tokens`` tokens, as units."""
    chars = max(1024, 4 * tokens)
    while True:
        text = filler_text(chars, kind=kind, seed=seed)
        if count_tokens(tokenizer, text) >= tokens:
            return text_units(text)
        chars *= 2


def sentence_boundary(units: Sequence[str], k: int, limit: int) -> int:
    """The first unit boundary at or after ``k`` (and before ``limit``) that ends a sentence or line."""
    for j in range(max(k, 0), min(limit, k + 200) + 1):
        if j == 0 or j == limit:
            return j
        prev = units[j - 1]
        if "\n" in prev or prev.rstrip().endswith((".", "!", "?", ":")):
            return j
    return min(k, limit)


def build_haystack(units: Sequence[str], k: int, needles: Sequence[tuple[float, str]]) -> str:
    """The first ``k`` filler units with each needle inserted at its depth (0 = start, 1 = end).

    Needles land on sentence boundaries, in order of depth, each on its own line.
    """
    cuts = sorted((sentence_boundary(units, round(d * k), k), i) for i, (d, _) in enumerate(needles))
    parts, start = [], 0
    for cut, i in cuts:
        parts.append("".join(units[start:cut]))
        chunk = parts[-1]
        sep = "" if not chunk or chunk.endswith("\n") else "\n"
        parts.append(sep + needles[i][1] + "\n")
        start = cut
    parts.append("".join(units[start:k]))
    return "".join(parts).rstrip()


def fit_length(tokenizer, build: Callable[[int], tuple[str, str]], hi: int, target: int, where: str, *,
               prompt: bool = True) -> int:
    """Largest k in [0, hi] with :func:`prompt_length` (context, question) <= target for ``build(k)``.

    ``build(k)`` returns (context, question) made of k filler units. Token counts grow with k (up to
    tokenizer merges), so bisection lands within one unit of the target. With ``prompt`` False the
    texts are counted as continuing text (no special tokens), e.g. a teacher-forced continuation.
    """
    def total(k: int) -> int:
        context, question = build(k)
        if prompt:
            return prompt_length(tokenizer, context, question)
        return count_tokens(tokenizer, context) + count_tokens(tokenizer, question)

    if total(0) > target:
        raise StudyError(f"{where}: the prompt without filler already takes {total(0)} tokens, more than the "
                         f"requested length {target}; raise the length")
    lo, top = 0, hi
    while lo < top:
        mid = (lo + top + 1) // 2
        if total(mid) <= target:
            lo = mid
        else:
            top = mid - 1
    return lo


def fit_haystack(tokenizer, units: Sequence[str], needles: Sequence[tuple[float, str]], *, instruction: str,
                 question: str, length: int, where: str) -> tuple[str, int]:
    """The context ``instruction`` + haystack of filler ``units`` with ``needles`` placed at their depths,
    sized so that context + ``question`` take ``length`` tokens (checked); returns (context, tokens)."""
    def build(k: int) -> tuple[str, str]:
        return instruction + build_haystack(units, k, needles), question

    context, _ = build(fit_length(tokenizer, build, len(units), length, where))
    tokens = prompt_length(tokenizer, context, question)
    check_length(tokens, length, where)
    return context, tokens


def draw_number(rng: random.Random, digits: int, avoid: str, taken: set[str] = frozenset()) -> str:
    """A random ``digits``-digit number (no leading zero) that occurs nowhere in ``avoid`` nor in ``taken``."""
    for _ in range(1000):
        value = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        if value not in avoid and value not in taken:
            return value
    raise StudyError(f"could not draw a {digits}-digit number absent from the filler; use more digits")


def check_length(tokens: int, target: int, where: str, tolerance: float = 0.05, slack: int = 0) -> None:
    """Raise when a built text misses its requested length by more than ``tolerance`` (or ``slack`` tokens)."""
    if abs(tokens - target) > max(tolerance * target, slack):
        raise StudyError(f"{where}: built a {tokens}-token prompt for a requested {target} tokens (more than "
                         f"{tolerance:.0%} off); the filler units are too coarse for this tokenizer")
