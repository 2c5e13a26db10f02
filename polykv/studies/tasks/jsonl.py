"""The user's own data as a study task: a JSONL file of contexts, questions and answers.

Each line is a JSON object with a context (prefilled, then compressed by the plan), a question (put in
``question_template`` and fed through the compressed cache) and the accepted answers (one string or a list
of strings). The field names are parameters (``context``, ``question`` and ``answers`` by default); an
optional ``id_field`` names a field holding each item's id, otherwise an item is named after its line.

Scoring is honest by default: the generation is cut at the first stop string (``stop``, the first line by
default; see :func:`~polykv.studies.tasks.base.answer_span`) and only that answer span is scored with
``metric`` (``string_match_part``, an accepted answer found in the span, by default), so a model that goes on
to repeat the context earns nothing for it. A bad line is an error naming the file, the line and the field.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from polykv.contract.params import ParamSpec
from polykv.errors import StudyError
from polykv.studies.tasks.base import TaskItem, param_error
from polykv.studies.tasks.files import FileTask, choose_items, read_lines, text_field, unique_id

JSONL_METRICS = ("string_match_part", "string_match_all", "exact_match", "qa_f1", "rouge_l", "first_number",
                 "code_sim")
"""Metrics for the user's data: each compares the answer span with the accepted answers (docs/tasks.md)."""


def _answers(value: Any, path: str, lineno: int, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise StudyError(f"{path} line {lineno}: field '{field}' must be a non-empty string or a non-empty list of "
                         f"non-empty strings (the accepted answers); got {value!r}")
    return tuple(value)


def load_jsonl(path: str, *, context_field: str = "context", question_field: str = "question",
               answers_field: str = "answers", id_field: str | None = None,
               question_template: str = "\n\nQuestion: {question}\nAnswer:", metric: str = "string_match_part",
               max_new_tokens: int = 32, stop: Sequence[str] = ("\n",)) -> list[TaskItem]:
    """Every item of the user's JSONL file ``path``, in file order (parameters as :class:`JsonlFileTask`'s)."""
    params = JsonlFileTask().params(
        path=path, context_field=context_field, question_field=question_field, answers_field=answers_field,
        id_field=id_field, question_template=question_template, metric=metric, max_new_tokens=max_new_tokens,
        stop=list(stop))
    return _load(params)


def _load(p: Mapping[str, Any]) -> list[TaskItem]:
    path = p["path"]
    fields = [p["context_field"], p["question_field"], p["answers_field"]] + ([p["id_field"]] if p["id_field"] else [])
    hint = (f"this task reads the fields {fields}; set context_field, question_field, answers_field (and id_field) "
            "to the names your file uses")
    items, seen = [], {}
    for lineno, rec in read_lines(path, fields, "JSONL", hint=hint):
        context = text_field(rec[p["context_field"]], path, lineno, p["context_field"])
        if not context.strip():
            raise StudyError(f"{path} line {lineno}: field '{p['context_field']}' is empty; every item needs a "
                             "context to compress")
        question = text_field(rec[p["question_field"]], path, lineno, p["question_field"])
        if not question.strip():
            raise StudyError(f"{path} line {lineno}: field '{p['question_field']}' is empty; every item needs a "
                             "question to ask after the compressed context")
        if p["id_field"]:
            raw_id = rec[p["id_field"]]
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or not str(raw_id):
                raise StudyError(f"{path} line {lineno}: field '{p['id_field']}' must be a non-empty string or an "
                                 f"integer (the item's id); got {raw_id!r}")
            item_id = str(raw_id)
        else:
            item_id = f"line-{lineno}"
        unique_id(seen, item_id, path, lineno, p["id_field"] or "line")
        meta = {"source": path, "line": lineno}
        if p["stop"]:
            meta["stop"] = tuple(p["stop"])
        items.append(TaskItem(
            task=JsonlFileTask.name, id=item_id, context=context,
            question=p["question_template"].format(question=question),
            answers=_answers(rec[p["answers_field"]], path, lineno, p["answers_field"]), metric=p["metric"],
            max_new_tokens=int(p["max_new_tokens"]), meta=meta))
    return items


class JsonlFileTask(FileTask):
    """The user's own items from a JSONL file on disk (``path=``); n items drawn by seed, in file order."""

    name = "jsonl_file"
    description = "your own context / question / answers items from a JSONL file on disk"
    metrics = JSONL_METRICS
    placeholder = "question"
    defaults: Mapping[str, Any] = {
        "path": None,
        "context_field": "context",
        "question_field": "question",
        "answers_field": "answers",
        "id_field": None,               # null: items are named line-<n>
        "question_template": "\n\nQuestion: {question}\nAnswer:",
        "metric": "string_match_part",
        "max_new_tokens": 32,
        "stop": ("\n",),                # the answer span ends at the first one; [] scores the whole generation
    }
    param_specs = {
        "path": ParamSpec(str, description="JSONL file, one item per line"),
        "context_field": ParamSpec(str, description="field holding the context"),
        "question_field": ParamSpec(str, description="field holding the question"),
        "answers_field": ParamSpec(str, description="field holding the answer or list of accepted answers"),
        "id_field": ParamSpec(str, nullable=True, description="field holding the item id; null = line number"),
        "question_template": ParamSpec(str, description="format string with {question}"),
        "metric": ParamSpec(str, choices=JSONL_METRICS, description="score of the answer span"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated"),
    }

    def check_params(self, params: Mapping[str, Any]) -> None:
        super().check_params(params)
        for key in ("context_field", "question_field", "answers_field", "id_field"):
            if params[key] == "":
                raise param_error(key, f"task '{self.name}': params.{key} is empty; name the field of your lines "
                                       "that holds it")

    def make_items(self, tokenizer, n: int | None, seed: int = 0, **params) -> list[TaskItem]:
        p = self.params(**params)
        return choose_items(_load(p), n, seed, self.name, p["path"])

