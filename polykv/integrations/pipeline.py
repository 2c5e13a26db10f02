"""The transformers pipeline task ``polykv-text-generation``: compress a context once, answer its questions.

Importing this module registers the task with transformers' ``PIPELINE_REGISTRY``::

    import polykv.integrations.pipeline  # noqa: F401 (registers the task)

    pipe = transformers.pipeline("polykv-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="Where is the key?", plan=plan, max_new_tokens=16)       # {"answer": "..."}
    pipe(context, questions=["Who?", "When?"], plan=plan)                           # {"answers": [...]}

Every call is :func:`polykv.runtime.answer.answer`: the context is prefilled and compressed by the plan,
then each question is fed through the compressed cache and answered greedily, each from the same
compressed context (the protocol of ``polykv study``). The plain ``text-generation`` pipeline inside
``with polykv.apply(model, plan):`` compresses the whole prompt instead, question included.
"""

from __future__ import annotations

import os
from typing import Any

import transformers
from transformers import Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from polykv.errors import RuntimeConfigError
from polykv.plan import Plan, load_plan
from polykv.runtime.answer import answer

TASK = "polykv-text-generation"
ANSWER_ARGS = ("max_new_tokens", "prompt_format", "bos", "chunk_size", "storage_dtype", "model_data", "seed")
"""Arguments passed on to :func:`polykv.runtime.answer.answer`, at pipeline creation or per call."""


class PolykvTextGeneration(Pipeline):
    """``pipe(context, question=... | questions=[...], plan=..., max_new_tokens=..., ...)``: one dict per context,
    ``{"answer": text}`` for one question, ``{"answers": [texts]}`` for a list; with ``return_bytes=True`` also
    ``context_bytes`` (the compressed context's resident K/V bytes) and ``end_bytes`` (per answer)."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, question: Any = None, questions: Any = None, plan: Any = None,
                             return_bytes: Any = None, **kwargs):
        unknown = sorted(set(kwargs) - set(ANSWER_ARGS))
        if unknown:
            raise RuntimeConfigError(f"pipeline '{TASK}': unknown argument(s) {', '.join(unknown)}; it takes "
                                     f"question or questions, plan, return_bytes and {', '.join(ANSWER_ARGS)}")
        if question is not None and questions is not None:
            raise RuntimeConfigError(f"pipeline '{TASK}': pass question=... (one) or questions=[...] (several), "
                                     f"not both")
        pre = {}
        if question is not None:
            pre["questions"] = question if isinstance(question, str) else _not_text("question", question)
        elif questions is not None:
            pre["questions"] = list(questions) if isinstance(questions, (list, tuple)) else \
                _not_text("questions", questions)
        forward = {k: v for k, v in kwargs.items() if v is not None}
        if plan is not None:
            forward["plan"] = _plan(plan)
        post = {} if return_bytes is None else {"return_bytes": bool(return_bytes)}
        return pre, forward, post

    def preprocess(self, context, questions=None):
        if not isinstance(context, str) or not context:
            raise RuntimeConfigError(f"pipeline '{TASK}': the input is the context to compress, a non-empty string; "
                                     f"got {context!r}")
        if questions is None:
            raise RuntimeConfigError(f"pipeline '{TASK}': no question: pass question=\"...\" or questions=[...] "
                                     f"with the context")
        return {"context": context, "questions": questions}

    def _forward(self, inputs, plan: Plan | None = None, **kwargs):
        if plan is None:
            raise RuntimeConfigError(f"pipeline '{TASK}': no plan: pass plan=... (a polykv Plan or a plan file) when "
                                     f"making the pipeline or calling it")
        got = answer(self.model, plan, self.tokenizer, context=inputs["context"], questions=inputs["questions"],
                     **kwargs)
        return {"answers": got, "single": isinstance(inputs["questions"], str)}

    def postprocess(self, outputs, return_bytes: bool = False):
        got = outputs["answers"]
        out: dict[str, Any] = {"answer": got.texts[0]} if outputs["single"] else {"answers": list(got.texts)}
        if return_bytes:
            out["context_bytes"] = got.context_bytes.total
            out["end_bytes"] = [b.total for b in got.end_bytes]
        return out


def _plan(plan: Any) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(str(plan))
    raise RuntimeConfigError(f"pipeline '{TASK}': plan must be a polykv Plan or a plan file's path, got a "
                             f"{type(plan).__name__}")


def _not_text(name: str, value: Any):
    raise RuntimeConfigError(f"pipeline '{TASK}': {name} must be "
                             + ("a string" if name == "question" else "a list of strings")
                             + f", got a {type(value).__name__}")


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=PolykvTextGeneration,
                                    pt_model=transformers.AutoModelForCausalLM, type="text")
