"""Passkey retrieval: a random number hidden at a random depth of long real filler text.

After Mohtashami & Jaggi (2023), "Landmark Attention: Random-Access Infinite Context Length for
Transformers" (the passkey test), as a plain completion prompt: the context is an instruction, the
filler and one line "The pass key is 71432. Remember it."; the question "What is the pass key? The
pass key is" is fed through the compressed cache and the first number generated must be the key.
The filler is real text from the offline corpus (:mod:`polykv.models.corpus`), not the repeated
"The grass is green" lines of the original, so positions differ in content. The default filler is
standard-library source code: the prose filler (the Python reference manual, which itself explains
"keys" and "special methods") distracts SmolLM2-135M even with a full cache (16/20 found at 2048 tokens,
against 20/20 with code filler), and a baseline below 100% would blur what compression alone costs.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from polykv.errors import StudyError
from polykv.studies.tasks.base import Task, TaskItem, draw_number, filler_units, fit_haystack
from polykv.models.corpus import KINDS
from polykv.contract.params import ParamSpec

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = "The pass key is {key}. Remember it."
QUESTION = "\n\nWhat is the pass key? The pass key is"


class PasskeyTask(Task):
    """Passkey retrieval at a requested prompt length (context + question tokens)."""

    name = "passkey"
    description = "retrieve a random number hidden at a random depth of real filler text"
    defaults: Mapping[str, Any] = {
        "length": 2048,       # prompt tokens as the runner feeds them: BOS, context, question
        "depth": None,        # fraction of the filler before the needle; None draws it uniformly per item
        "digits": 5,          # digits of the key (no leading zero)
        "filler": "code",     # corpus kind of the filler: "code" or "prose" (see the module docstring)
        "max_new_tokens": 8,  # tokens generated for the answer
    }
    param_specs = {
        "length": ParamSpec(int, low=1, high=1 << 22, description="prompt tokens"),
        "depth": ParamSpec(float, low=0.0, high=1.0, nullable=True, description="needle depth, null = random"),
        "digits": ParamSpec(int, low=1, high=64, description="digits of the key"),
        "filler": ParamSpec(str, choices=KINDS, description="corpus kind of the filler"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated for the answer"),
    }

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        length, depth, digits = int(params["length"]), params["depth"], int(params["digits"])
        if depth is None:
            depth = rng.random()
        if not 0.0 <= float(depth) <= 1.0:
            raise StudyError(f"task 'passkey': depth must lie in [0, 1] or be None; got {depth}")
        if digits < 1:
            raise StudyError(f"task 'passkey': digits must be >= 1; got {digits}")
        units = filler_units(tokenizer, length, kind=params["filler"], seed=rng.randrange(2 ** 31))
        key = draw_number(rng, digits, "".join(units))
        needle = NEEDLE.format(key=key)
        question = QUESTION
        context, tokens = fit_haystack(tokenizer, units, [(float(depth), needle)], instruction=INSTRUCTION,
                                       question=question, length=length, where=f"task 'passkey' item {index}")
        return TaskItem(task=self.name, id=f"passkey-{index}", context=context, question=question, answers=(key,),
                        metric="first_number", max_new_tokens=int(params["max_new_tokens"]),
                        meta={"depth": float(depth), "key": key, "tokens": tokens, "length": length})
