"""Aggregation, RULER style: common-words extraction (``cwe``) and frequent-words extraction (``fwe``).

After Hsieh et al. (2024), "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(``scripts/data/synthetic/common_words_extraction.py`` and ``freq_words_extraction.py``, templates from
``scripts/data/synthetic/constants.py``). Both ask for the words that occur most often in a long list, so the
answer depends on the whole context rather than on one needle; both are scored with RULER's
``string_match_all`` (the fraction of the answer words found in the generation).

- **cwe**: ``num_cw`` (10) common words occur ``freq_cw`` (30) times each and the other words ``freq_ucw`` (3)
  times, shuffled into one numbered line "1. w 2. w ...". One worked example comes first (40 words, 10 / 3
  repeats, with its answer). When ``length`` + ``max_new_tokens`` (RULER's ``max_seq_length``, which counts the
  generated tokens) is below 4,096, RULER's short form applies: 6 / 1 repeats, and an example of 20 words with
  3 / 1 repeats. The number of words is the largest that fits ``length``. Words come
  from a fixed list shipped with polykv (``polykv/data/ruler_words.txt``: 2,654 lower-case words drawn from the
  offline corpus's prose, the template's own words left out), not from the ``wonderwords`` package RULER reads,
  so polykv needs no download; it holds enough distinct words for about 32k tokens. The example's words and the
  list's are disjoint (RULER draws them independently).
- **fwe**: a vocabulary of ``length // 50`` random ``word_length``-letter coded words (80 at 4k), ranked at
  random; rank ``k`` occurs ``floor(N k^-alpha / zeta(alpha))`` times, and rank 1 is replaced by "..." (noise).
  N is the largest count that fits ``length`` (RULER grows it in steps of ``length / 32`` and steps back once;
  bisection lands on the largest). The answer is the words of ranks 2-4.

The question (and RULER's answer prefix) is fed through the compressed cache after the context, as in every
task here. Item ``i`` depends only on (task, seed, ``i``, parameters).
"""

from __future__ import annotations

import functools
import os
import random
import string
from typing import Any, Mapping

from polykv.contract.params import ParamSpec
from polykv.errors import StudyError
from polykv.studies.tasks.base import Task, TaskItem, check_length, fit_length, param_error, prompt_length

WORDS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "ruler_words.txt")

CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the {n} most common words in the above list?"
CWE_PREFIX = " Answer: The top {n} words that appear most often in the list are:"
FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words. ")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
NOISE = "..."


@functools.lru_cache(maxsize=1)
def cwe_vocabulary() -> tuple[str, ...]:
    """The shipped word list of ``cwe`` (sorted, distinct)."""
    with open(WORDS_FILE, encoding="utf-8") as fh:
        return tuple(w for w in fh.read().split() if w)


def numbered(words) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


class CommonWordsTask(Task):
    """RULER cwe: name the ``num_cw`` words repeated most often in a long numbered list."""

    name = "cwe"
    description = "RULER common-words extraction: the 10 most common words of a long numbered list"
    defaults: Mapping[str, Any] = {
        "length": 4096,        # prompt tokens as the runner feeds them: BOS, context, question
        "num_cw": 10,          # common words (the answer)
        "freq_cw": None,       # repeats of each common word; null = RULER's 30 (6 below 4,096 tokens in all)
        "freq_ucw": None,      # repeats of every other word; null = RULER's 3 (1 below 4,096 tokens in all)
        "max_new_tokens": 120,
    }
    param_specs = {
        "length": ParamSpec(int, low=1, high=1 << 22, description="prompt tokens"),
        "num_cw": ParamSpec(int, low=1, high=100, description="common words asked for"),
        "freq_cw": ParamSpec(int, low=2, high=1000, nullable=True, description="repeats of each common word"),
        "freq_ucw": ParamSpec(int, low=1, high=1000, nullable=True, description="repeats of every other word"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated for the answer"),
    }

    @staticmethod
    def repeats(params: Mapping[str, Any]) -> tuple[int, int, tuple[int, int, int]]:
        """(freq_cw, freq_ucw, (example words, example freq_cw, example freq_ucw)) for ``params``."""
        short = int(params["length"]) + int(params["max_new_tokens"]) < 4096   # RULER's max_seq_length
        cw = params["freq_cw"] if params["freq_cw"] is not None else (6 if short else 30)
        ucw = params["freq_ucw"] if params["freq_ucw"] is not None else (1 if short else 3)
        return int(cw), int(ucw), ((20, 3, 1) if short else (40, 10, 3))

    def check_params(self, params: Mapping[str, Any]) -> None:
        cw, ucw, _ = self.repeats(params)
        if cw <= ucw:
            raise param_error("freq_cw", f"task '{self.name}': params.freq_cw ({cw}) must exceed params.freq_ucw "
                                         f"({ucw}), or the common words are not the most common")

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        length, n = int(params["length"]), int(params["num_cw"])
        cw, ucw, (ex_words, ex_cw, ex_ucw) = self.repeats(params)
        where = f"task '{self.name}' item {index}"
        vocab = list(cwe_vocabulary())
        rng.shuffle(vocab)
        example, pool = vocab[:max(ex_words, n)], vocab[max(ex_words, n):]
        example_list = example[:n] * ex_cw + example[n:] * ex_ucw
        rng.shuffle(example_list)
        block = (CWE_INSTRUCTION + numbered(example_list) + CWE_QUESTION.format(n=n) + CWE_PREFIX.format(n=n) + " "
                 + numbered(example[:n]) + "\n")
        seed = rng.randrange(2 ** 31)
        question = CWE_QUESTION.format(n=n) + CWE_PREFIX.format(n=n)

        def build(k: int) -> tuple[str, str]:
            words = pool[:n + k]
            listed = words[:n] * cw + words[n:] * ucw
            random.Random(seed).shuffle(listed)
            return block + CWE_INSTRUCTION + numbered(listed), question

        hi = len(pool) - n
        k = fit_length(tokenizer, build, hi, length, where)
        context, _ = build(k)
        tokens = prompt_length(tokenizer, context, question)
        if k == hi and tokens < 0.95 * length:
            raise StudyError(f"{where}: the shipped word list ({len(cwe_vocabulary())} words) fills only {tokens} "
                             f"of the requested {length} tokens; lower params.length or raise params.freq_ucw")
        check_length(tokens, length, where)
        return TaskItem(task=self.name, id=f"{self.name}-{index}", context=context, question=question,
                        answers=tuple(pool[:n]), metric="string_match_all",
                        max_new_tokens=int(params["max_new_tokens"]),
                        meta={"words": n + k, "tokens": tokens, "length": length})


def zeta(alpha: float) -> float:
    """Riemann zeta at ``alpha`` > 1 (sum to 10^4 plus the Euler-Maclaurin tail; error < 1e-12 for alpha >= 1.5)."""
    m = 10_000
    return sum(k ** -alpha for k in range(1, m)) + m ** (1 - alpha) / (alpha - 1) + 0.5 * m ** -alpha


class FrequentWordsTask(Task):
    """RULER fwe: name the three most frequent coded words of a Zipf-distributed text."""

    name = "fwe"
    description = "RULER frequent-words extraction: the three most frequent coded words of a Zipf text"
    defaults: Mapping[str, Any] = {
        "length": 4096,        # prompt tokens as the runner feeds them: BOS, context, question
        "alpha": 2.0,          # Zipf exponent of the word counts (> 1)
        "word_length": 6,      # letters of each coded word
        "vocab_size": None,    # coded words; null = length // 50 (RULER)
        "max_new_tokens": 50,
    }
    param_specs = {
        "length": ParamSpec(int, low=1, high=1 << 22, description="prompt tokens"),
        "alpha": ParamSpec(float, low=1.0001, high=10.0, description="Zipf exponent"),
        "word_length": ParamSpec(int, low=3, high=32, description="letters of each coded word"),
        "vocab_size": ParamSpec(int, low=5, high=1 << 20, nullable=True, description="coded words"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated for the answer"),
    }

    def check_params(self, params: Mapping[str, Any]) -> None:
        if params["vocab_size"] is None and int(params["length"]) // 50 < 5:
            raise param_error("length", f"task '{self.name}': params.length {params['length']} gives fewer than 5 "
                                        "coded words (length // 50); use at least 250 tokens or set vocab_size")

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        length, alpha, letters = int(params["length"]), float(params["alpha"]), int(params["word_length"])
        size = int(params["vocab_size"] or length // 50)
        words: set[str] = set()
        while len(words) < size:
            words.add("".join(rng.choices(string.ascii_lowercase, k=letters)))
        vocab = sorted(words)
        rng.shuffle(vocab)
        vocab[0] = NOISE                       # the top rank is noise
        z = zeta(alpha)
        seed = rng.randrange(2 ** 31)
        question = FWE_QUESTION + FWE_PREFIX

        def build(total: int) -> tuple[str, str]:
            text = [w for rank, w in enumerate(vocab, start=1) for _ in range(int(total * rank ** -alpha / z))]
            random.Random(seed).shuffle(text)
            return FWE_INSTRUCTION + " ".join(text), question

        where = f"task '{self.name}' item {index}"
        total = fit_length(tokenizer, build, 4 * length, length, where)
        context, _ = build(total)
        tokens = prompt_length(tokenizer, context, question)
        check_length(tokens, length, where)
        counts = [int(total * rank ** -alpha / z) for rank in (2, 3, 4, 5)]
        if not counts[0] > counts[1] > counts[2] > counts[3]:
            raise StudyError(f"{where}: at {length} tokens the three most frequent coded words occur {counts[:3]} "
                             f"times against {counts[3]} for the next; raise params.length or params.alpha")
        return TaskItem(task=self.name, id=f"{self.name}-{index}", context=context, question=question,
                        answers=tuple(vocab[1:4]), metric="string_match_all",
                        max_new_tokens=int(params["max_new_tokens"]),
                        meta={"words": total, "tokens": tokens, "length": length})
