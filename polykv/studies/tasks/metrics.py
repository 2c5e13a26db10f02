"""Scoring functions for study tasks: generated text against an item's answers, a number in [0, 1].

RULER's metrics (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"): ``string_match_all`` (fraction of references found in the prediction, case-insensitive) and
``string_match_part`` (1 when any reference is found). LongBench's English metrics (Bai et al., 2023,
"LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding", ``metrics.py``): token F1,
classification, passage retrieval, passage count, code similarity and ROUGE-L; each is the maximum over
the item's accepted answers, as LongBench's evaluator takes it. SQuAD's exact match (Rajpurkar et al., 2016)
compares the normalised prediction with each answer.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable

from polykv.errors import StudyError


def string_match_all(pred: str, refs, item=None) -> float:
    """RULER: fraction of references that occur in the prediction (case-insensitive)."""
    low = pred.lower()
    return sum(r.lower() in low for r in refs) / len(refs)


def string_match_part(pred: str, refs, item=None) -> float:
    """RULER: 1.0 when any reference occurs in the prediction (case-insensitive)."""
    low = pred.lower()
    return float(any(r.lower() in low for r in refs))


def first_number(pred: str, refs, item=None) -> float:
    """1.0 when the first run of digits in the prediction equals a reference (passkey retrieval)."""
    m = re.search(r"\d+", pred)
    return float(m is not None and m.group(0) in refs)


def normalize_answer(s: str) -> str:
    """SQuAD / LongBench normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, refs, item=None) -> float:
    """SQuAD exact match: 1.0 when the prediction equals a reference after :func:`normalize_answer`."""
    return float(any(normalize_answer(pred) == normalize_answer(r) for r in refs))


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, refs, item=None) -> float:
    """LongBench ``qa_f1_score``: token F1 after :func:`normalize_answer`, best over references."""
    return max(_f1(normalize_answer(pred).split(), normalize_answer(r).split()) for r in refs)


def classification(pred: str, refs, item=None) -> float:
    """LongBench ``classification_score``: 1/k when the reference is among the k class names found."""
    classes = list((item.meta.get("all_classes") if item is not None else None) or [])
    if not classes:
        raise StudyError("the classification metric needs the item's meta['all_classes'] (LongBench field "
                         "'all_classes'); the file lacks it")
    best = 0.0
    for ref in refs:
        found = [c for c in classes if c in pred]
        found = [c for c in found if not (c in ref and c != ref)]
        best = max(best, 1.0 / len(found) if ref in found else 0.0)
    return best


def retrieval(pred: str, refs, item=None) -> float:
    """LongBench ``retrieval_score``: share of the numbers in the prediction naming the right paragraph."""
    best = 0.0
    for ref in refs:
        m = re.findall(r"Paragraph (\d+)", ref)
        target = m[0] if m else ref
        numbers = re.findall(r"\d+", pred)
        right = sum(n == str(target) for n in numbers)
        best = max(best, right / len(numbers) if numbers else 0.0)
    return best


def count(pred: str, refs, item=None) -> float:
    """LongBench ``count_score``: share of the numbers in the prediction equal to the count."""
    numbers = re.findall(r"\d+", pred)
    if not numbers:
        return 0.0
    return max(sum(n == str(r) for n in numbers) / len(numbers) for r in refs)


def code_sim(pred: str, refs, item=None) -> float:
    """LongBench ``code_sim_score``: similarity ratio of the first code line (fuzzywuzzy's
    ``fuzz.ratio`` is difflib's ``SequenceMatcher.ratio`` rounded to a percentage)."""
    line = ""
    for candidate in pred.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return max(round(100 * difflib.SequenceMatcher(None, line, r).ratio()) / 100 for r in refs)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, refs, item=None) -> float:
    """ROUGE-L F1 on lower-cased word tokens (LongBench summarisation datasets use ROUGE-L F)."""
    best = 0.0
    p = re.findall(r"\w+", pred.lower())
    for r in refs:
        t = re.findall(r"\w+", r.lower())
        lcs = _lcs(p, t)
        if lcs:
            prec, rec = lcs / len(p), lcs / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def fidelity(pred: str, refs, item=None) -> float:
    """Continuation items are not scored from text: the runner computes KL, top-1 agreement and perplexity."""
    raise StudyError("continuation-fidelity items are teacher-forced: the study runner computes KL and top-1 "
                     "agreement against the full cache and perplexity; there is no text score")


METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "first_number": first_number,
    "exact_match": exact_match,
    "qa_f1": qa_f1,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
    "rouge_l": rouge_l,
    "fidelity": fidelity,
}


def score(metric: str, pred: str, item) -> float:
    """Score ``pred`` against ``item.answers`` with the metric called ``metric``."""
    fn = METRICS.get(metric)
    if fn is None:
        raise StudyError(f"item {item.id!r} of task '{item.task}' names unknown metric {metric!r}; "
                         f"available: {sorted(METRICS)}")
    if not item.answers:
        raise StudyError(f"item {item.id!r} of task '{item.task}' has no answers to score against")
    return float(fn(pred, item.answers, item))
