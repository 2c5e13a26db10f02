"""Long-text continuation fidelity: how far a compressed cache moves the next-token distribution.

An item is one long real text from the offline corpus (whole documents joined by blank lines, see
:func:`polykv.models.corpus.filler_text`) cut into a ``context`` of about
``context_tokens`` tokens and the ``continuation`` that follows it (``answers[0]``, about
``continuation_tokens`` tokens). The runner prefills and compresses the context, teacher-forces the
continuation through the compressed cache and, at every continuation position, compares the next-token
distribution with the one computed from the full cache: KL(full || compressed), top-1 agreement, and
the perplexity of the continuation. This is the quantity PolyKV's and MoE-nD's calibration signals
(delta-PPL, KL) approximate, measured directly on held-out text.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from polykv.studies.tasks.base import (TEACHER_FORCED, Task, TaskItem, check_length, count_tokens, filler_units,
                                       fit_length, prompt_length)
from polykv.models.corpus import KINDS
from polykv.contract.params import ParamSpec


CONTINUATION_SLACK = 16  # tokens a continuation may miss its requested length by (or 5%, whichever is more)


class ContinuationTask(Task):
    """Teacher-forced continuation of long real text (KL / top-1 / perplexity, computed by the runner)."""

    name = "continuation"
    description = "teacher-forced continuation of real text: KL and top-1 agreement against the full cache, perplexity"
    mode = TEACHER_FORCED
    defaults: Mapping[str, Any] = {
        "context_tokens": 2048,      # tokens of the compressed context (its BOS included, where one is placed)
        "continuation_tokens": 256,  # tokens teacher-forced through the compressed cache
        "kind": "prose",             # corpus kind: "prose" or "code"
    }
    param_specs = {
        "context_tokens": ParamSpec(int, low=1, high=1 << 22, description="tokens of the compressed context"),
        "continuation_tokens": ParamSpec(int, low=1, high=1 << 20, description="tokens teacher-forced"),
        "kind": ParamSpec(str, choices=KINDS, description="corpus kind"),
    }

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        n_ctx, n_cont = int(params["context_tokens"]), int(params["continuation_tokens"])
        where = f"task '{self.name}' item {index}"
        filler_seed = rng.randrange(2 ** 31)
        units = filler_units(tokenizer, int(1.1 * (n_ctx + n_cont)) + 16, kind=params["kind"], seed=filler_seed)
        k = fit_length(tokenizer, lambda j: ("".join(units[:j]), ""), len(units), n_ctx, where)
        rest = units[k:]
        m = fit_length(tokenizer, lambda j: ("".join(rest[:j]), ""), len(rest), n_cont, where, prompt=False)
        context, continuation = "".join(units[:k]), "".join(rest[:m]).rstrip()
        ctx_tokens, cont_tokens = prompt_length(tokenizer, context, ""), count_tokens(tokenizer, continuation)
        check_length(ctx_tokens, n_ctx, where + " context")
        # A short continuation cannot always land within 5% at word granularity: allow one long word.
        check_length(cont_tokens, n_cont, where + " continuation", slack=CONTINUATION_SLACK)
        return TaskItem(task=self.name, id=f"{self.name}-{index}", context=context, question="",
                        answers=(continuation,), metric="fidelity", max_new_tokens=0,
                        meta={"context_tokens": ctx_tokens, "continuation_tokens": cont_tokens,
                              "kind": params["kind"], "filler_seed": filler_seed})
