"""Benchmark files a user already has on disk: LongBench and RULER JSONL, read offline.

LongBench (Bai et al., 2023, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding") lines carry ``context``, ``input``, ``answers``, ``all_classes``, ``length``, ``dataset``
and ``_id``; the context is compressed and the question (``input`` in ``question_template``) is fed
afterwards. The metric follows LongBench's dataset-to-metric table for the English datasets.

RULER (Hsieh et al., 2024) lines carry ``input`` (context and question in one prompt), ``outputs``,
``length`` and ``index`` (and, in newer files, ``answer_prefix``). RULER's templates end with the
question on its own last line, so the question is everything after the last ``question_separator``;
the answer prefix, when present, is appended to it.

Every file task (these two and :mod:`~polykv.studies.tasks.jsonl`'s ``jsonl_file``) takes ``metric``,
``max_new_tokens`` and ``stop``: an item with stop strings is scored on its answer span (the generation up to
the first stop string, :func:`~polykv.studies.tasks.base.answer_span`), so that text generated after the
answer (a model going on to repeat the context) earns nothing.

A malformed line is a :class:`~polykv.errors.StudyError` naming the file, the line number and the field.
"""

from __future__ import annotations

import os
import random
import string
from typing import Any, ClassVar, Iterator, Mapping, Sequence

from polykv.contract.params import ParamSpec
from polykv.errors import OutputError, StudyError
from polykv.strict_json import JsonInputError, check_readable_file, loads_strict
from polykv.studies.tasks.base import Task, TaskItem, param_error
from polykv.studies.tasks.metrics import METRICS

USER_DATA_HINT = ("For your own data (lines with 'context', 'question' and 'answers') use the task 'jsonl_file' "
                  "(docs/tasks.md).")

LONGBENCH_FIELDS = ("context", "input", "answers", "all_classes", "length", "dataset", "_id")
RULER_FIELDS = ("input", "outputs", "length", "index")

# LongBench's eval.py dataset2metric and dataset2maxlen (English datasets; "_e" suffixes are LongBench-E).
LONGBENCH_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1", "gov_report": "rouge_l", "qmsum": "rouge_l",
    "multi_news": "rouge_l", "samsum": "rouge_l", "trec": "classification", "passage_retrieval_en": "retrieval",
    "passage_count": "count", "lcc": "code_sim", "repobench-p": "code_sim",
}
# LongBench's eval.py scores only the first line of the prediction for these datasets.
LONGBENCH_FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# A dataset outside LongBench's tables: answer within 32 tokens, scored on the first line.
OTHER_MAXLEN, OTHER_STOP = 32, ("\n",)
LONGBENCH_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}


def read_lines(path: str, fields: Sequence[str], fmt: str, hint: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line of the JSONL file ``path``; a line that is not a JSON
    object holding ``fields`` is an error naming the file and line (``hint`` ends a missing-field message)."""
    if not path:
        raise StudyError(f"a {fmt} task needs path= pointing at a {fmt} JSONL file on disk")
    if not os.path.lexists(path):
        raise StudyError(f"{path}: no such {fmt} JSONL file")
    try:
        check_readable_file(path, f"{fmt} JSONL file")
        with open(path, "rb") as fh:
            data = fh.read()
    except OutputError as exc:
        raise StudyError(str(exc)) from None
    except OSError as exc:
        raise StudyError(f"{path}: cannot read the {fmt} file ({exc.strerror}); check the path and permissions") \
            from None
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StudyError(f"{path} line {lineno}: not UTF-8 text (byte {exc.start}); {fmt} files are UTF-8 "
                             "JSONL") from None
        if not line.strip():
            continue
        try:
            record = loads_strict(line)
        except JsonInputError as exc:
            where = f" at column {exc.column}" if exc.line else ""
            raise StudyError(f"{path} line {lineno}: not valid JSON ({exc.message}{where}); "
                             f"{fmt} files hold one JSON object per line") from None
        if not isinstance(record, dict):
            raise StudyError(f"{path} line {lineno}: expected a JSON object with fields {list(fields)}, "
                             f"got {type(record).__name__}")
        missing = [f for f in fields if f not in record]
        if missing:
            if hint is None:
                hint = f"{fmt} lines carry {list(fields)}. Is this a {fmt} file? {USER_DATA_HINT}"
            raise StudyError(f"{path} line {lineno}: missing field(s) {missing} (the line has {sorted(record)}); "
                             + hint)
        yield lineno, record


def unique_id(seen: dict[str, int], item_id: str, path: str, lineno: int, field: str) -> None:
    """Results are keyed by item id: a repeated id would silently drop an item from every report."""
    if item_id in seen:
        raise StudyError(f"{path} line {lineno}: field '{field}' is {item_id!r}, the id of line {seen[item_id]} "
                         f"too; item ids must be unique within a file")
    seen[item_id] = lineno


def _str_list(value, path: str, lineno: int, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, (str, int, float)) for v in value):
        raise StudyError(f"{path} line {lineno}: field '{field}' must be a non-empty list of strings; got {value!r}")
    return tuple(str(v) for v in value)


def text_field(value, path: str, lineno: int, field: str) -> str:
    if not isinstance(value, str):
        raise StudyError(f"{path} line {lineno}: field '{field}' must be a string; got {type(value).__name__}")
    return value


def load_longbench(path: str, *, question_template: str = "\n\nQuestion: {input}\nAnswer:",
                   metric: str | None = None, max_new_tokens: int | None = None,
                   stop: Sequence[str] | None = None) -> list[TaskItem]:
    """Every item of a LongBench JSONL file, in file order.

    Parameters
    ----------
    path : str
        A LongBench ``<dataset>.jsonl`` (or LongBench-E ``<dataset>_e.jsonl``) file.
    question_template : str
        Format string for the question fed after the compressed context; ``{input}`` is the line's input.
    metric : str, optional
        Force a metric from :data:`~polykv.studies.tasks.metrics.METRICS`; by default LongBench's own
        metric for the line's dataset (Chinese datasets need an explicit choice: LongBench scores them
        with jieba word segmentation, which polykv does not ship).
    max_new_tokens : int, optional
        Tokens to generate; by default LongBench's length for the dataset, 32 for a dataset outside its table.
    stop : sequence of str, optional
        Score the generation up to the first of these strings; by default LongBench's rule (the first line
        for trec, triviaqa, samsum and lsht, the whole generation otherwise) and the first line for a
        dataset outside LongBench's table.
    """
    check_file_options(LongBenchFileTask, metric=metric, max_new_tokens=max_new_tokens, stop=stop,
                       question_template=question_template)
    items, seen = [], {}
    for lineno, rec in read_lines(path, LONGBENCH_FIELDS, "LongBench"):
        dataset = text_field(rec["dataset"], path, lineno, "dataset")
        unique_id(seen, str(rec["_id"]), path, lineno, "_id")
        if not text_field(rec["context"], path, lineno, "context").strip():
            raise StudyError(f"{path} line {lineno}: field 'context' is empty; every item needs a context to "
                             "compress")
        base = dataset[:-2] if dataset.endswith("_e") else dataset
        chosen = metric or LONGBENCH_METRIC.get(base)
        if chosen is None:
            raise StudyError(f"{path} line {lineno}: no built-in LongBench metric for dataset '{dataset}' "
                             f"(supported: {sorted(LONGBENCH_METRIC)}); pass metric= explicitly")
        all_classes = rec["all_classes"]
        if all_classes is not None and not isinstance(all_classes, list):
            raise StudyError(f"{path} line {lineno}: field 'all_classes' must be a list or null")
        if stop is not None:
            span = stop
        elif base in LONGBENCH_MAXLEN:  # LongBench's own protocol for its datasets
            span = ("\n",) if base in LONGBENCH_FIRST_LINE else ()
        else:
            span = OTHER_STOP
        meta = {"dataset": dataset, "all_classes": all_classes, "length": rec["length"], "source": path,
                "line": lineno}
        if span:
            meta["stop"] = tuple(span)
        items.append(TaskItem(
            task=LongBenchFileTask.name, id=str(rec["_id"]),
            context=text_field(rec["context"], path, lineno, "context"),
            question=question_template.format(input=text_field(rec["input"], path, lineno, "input")),
            answers=_str_list(rec["answers"], path, lineno, "answers"), metric=chosen,
            max_new_tokens=max_new_tokens or LONGBENCH_MAXLEN.get(base, OTHER_MAXLEN), meta=meta))
    return items


def load_ruler(path: str, *, metric: str = "string_match_all", question_separator: str = "\n",
               max_new_tokens: int = 128, stop: Sequence[str] = ()) -> list[TaskItem]:
    """Every item of a RULER JSONL file, in file order, with the question split off the prompt.

    Parameters
    ----------
    path : str
        A RULER ``validation.jsonl`` file.
    metric : str
        ``"string_match_all"`` (RULER's default) or ``"string_match_part"`` (RULER's qa tasks).
    question_separator : str
        The question starts after the last occurrence of this string in ``input``.
    max_new_tokens : int
        Tokens to generate (RULER uses 128 for niah, 30 for vt, 32 for qa).
    stop : sequence of str
        Score the generation up to the first of these strings; none by default (RULER scores the whole
        stripped generation).
    """
    check_file_options(RulerFileTask, metric=metric, max_new_tokens=max_new_tokens, stop=stop)
    items, seen = [], {}
    for lineno, rec in read_lines(path, RULER_FIELDS, "RULER"):
        prompt = text_field(rec["input"], path, lineno, "input")
        unique_id(seen, str(rec["index"]), path, lineno, "index")
        cut = prompt.rstrip().rfind(question_separator)
        if cut <= 0:
            raise StudyError(f"{path} line {lineno}: field 'input' has no {question_separator!r} before its last "
                             f"line, so the question cannot be split from the context; pass question_separator=")
        if not prompt[:cut].strip():
            raise StudyError(f"{path} line {lineno}: field 'input' has an empty context before the question; every "
                             "item needs a context to compress")
        prefix = rec.get("answer_prefix") or ""
        items.append(TaskItem(
            task=RulerFileTask.name, id=str(rec["index"]), context=prompt[:cut], question=prompt[cut:] + prefix,
            answers=_str_list(rec["outputs"], path, lineno, "outputs"), metric=metric,
            max_new_tokens=int(max_new_tokens),
            meta={"length": rec["length"], "source": path, "line": lineno, **({"stop": tuple(stop)} if stop else {})}))
    return items


def choose_items(items: list[TaskItem], n: int | None, seed: int, task: str, path: str) -> list[TaskItem]:
    if n is None or n == len(items):
        return items
    if n < 0 or n > len(items):
        raise StudyError(f"task '{task}': asked for {n} items but {path} holds {len(items)}")
    keep = sorted(random.Random(f"{task}:{seed}").sample(range(len(items)), n))
    return [items[i] for i in keep]


class FileTask(Task):
    """A task reading items from a JSONL file (``path=``): n items drawn by seed, kept in file order.

    Subclasses name their ``metrics`` (the choices of ``params.metric``) and the ``placeholder`` their
    ``question_template`` must hold; :meth:`check_params` checks the options every file task shares.
    """

    metrics: ClassVar[tuple[str, ...]] = tuple(m for m in sorted(METRICS) if m != "fidelity")
    placeholder: ClassVar[str | None] = None

    def check_params(self, params: Mapping[str, Any]) -> None:
        metric = params.get("metric")
        if metric is not None and metric not in self.metrics:
            raise param_error("metric", f"task '{self.name}': params.metric {metric!r} is not one of its metrics "
                                        f"{list(self.metrics)}; pick one (docs/tasks.md describes them)")
        stop = params.get("stop")
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x
                                                                                 for x in stop)):
            raise param_error("stop", f"task '{self.name}': params.stop must be a list of non-empty strings (the "
                                      f"answer ends at the first one found), e.g. [\"\\n\"]; got {stop!r}")
        if self.placeholder is not None:
            check_template(self.name, params["question_template"], self.placeholder)


def check_template(task: str, template: Any, placeholder: str) -> None:
    """``template`` must be a format string whose only field is ``{placeholder}``."""
    where = f"task '{task}': params.question_template {template!r}"
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise param_error("question_template", f"{where} is not a valid format string ({exc}); write "
                          f"{{{placeholder}}} where the question goes and double literal braces ({{{{ }}}})") from None
    if fields != {placeholder}:
        raise param_error("question_template", f"{where} must hold the field {{{placeholder}}} and no other "
                          f"(found {sorted(fields)}); double literal braces ({{{{ }}}})")


def check_file_options(cls: type[FileTask], **options) -> None:
    """The shared options given to a loader function, checked as the task checks its parameters."""
    task = cls()
    task.params(**{k: v for k, v in options.items() if v is not None or task.defaults.get(k) is None})


class LongBenchFileTask(FileTask):
    """Items from a LongBench JSONL file on disk (``path=``); n items drawn by seed, in file order."""

    name = "longbench_file"
    description = "LongBench items from a JSONL file on disk"
    placeholder = "input"
    defaults: Mapping[str, Any] = {"path": None, "question_template": "\n\nQuestion: {input}\nAnswer:",
                                   "metric": None, "max_new_tokens": None, "stop": None}
    param_specs = {"path": ParamSpec(str, description="LongBench JSONL file"),
                   "question_template": ParamSpec(str, description="format string with {input}"),
                   "metric": ParamSpec(str, choices=FileTask.metrics, nullable=True,
                                       description="null = LongBench's metric of the dataset"),
                   "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, nullable=True,
                                               description="null = LongBench's length of the dataset"),
                   }

    def make_items(self, tokenizer, n: int | None, seed: int = 0, **params) -> list[TaskItem]:
        p = self.params(**params)
        items = load_longbench(p["path"], question_template=p["question_template"], metric=p["metric"],
                               max_new_tokens=p["max_new_tokens"], stop=p["stop"])
        return choose_items(items, n, seed, self.name, p["path"])


class RulerFileTask(FileTask):
    """Items from a RULER JSONL file on disk (``path=``); n items drawn by seed, in file order."""

    name = "ruler_file"
    description = "RULER items from a JSONL file on disk"
    defaults: Mapping[str, Any] = {"path": None, "metric": "string_match_all", "question_separator": "\n",
                                   "max_new_tokens": 128, "stop": ()}
    param_specs = {"path": ParamSpec(str, description="RULER JSONL file"),
                   "metric": ParamSpec(str, choices=FileTask.metrics),
                   "question_separator": ParamSpec(str, description="the question starts after its last occurrence"),
                   "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated")}

    def make_items(self, tokenizer, n: int | None, seed: int = 0, **params) -> list[TaskItem]:
        p = self.params(**params)
        items = load_ruler(p["path"], metric=p["metric"], question_separator=p["question_separator"],
                           max_new_tokens=p["max_new_tokens"], stop=p["stop"])
        return choose_items(items, n, seed, self.name, p["path"])
