"""Variable tracking, RULER style: follow chains of assignments hidden in long filler text.

After Hsieh et al. (2024), "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(``scripts/data/synthetic/variable_tracking.py``). A chain starts with "VAR ABCDE = 12345." and each
hop assigns the previous variable to a new one ("VAR FGHIJ = VAR ABCDE."); statements appear in chain
order at random depths of the haystack. The question asks for every variable that holds the first
chain's value; the score is RULER's ``string_match_all`` over that chain's variable names. Extra chains
(``num_chains`` > 1) are distractors with their own values. ``answer_prefix="VAR"`` ends the question with
" VAR", the word every answer starts with: small models given RULER's bare question describe the text instead of
listing names (SmolLM2-135M scored 0 of 11 items with the full cache, 1-2 hops, plain and chat prompts; primed,
it names the variable holding the value on every item and the next hop on some).
"""

from __future__ import annotations

import random
import string
from typing import Any, Mapping

from polykv.errors import StudyError
from polykv.studies.tasks.base import Task, TaskItem, draw_number, filler_units, fit_haystack
from polykv.models.corpus import KINDS
from polykv.contract.params import ParamSpec

INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            "Answer: According to the chain(s) of variables in the text above, {count} variables are assigned "
            "the value {value}, they are:")


class VariableTrackingTask(Task):
    """Multi-hop variable tracking at a requested prompt length."""

    name = "variable_tracking"
    description = "RULER variable tracking: list every variable bound to a value through a chain of assignments"
    defaults: Mapping[str, Any] = {
        "length": 2048,       # prompt tokens as the runner feeds them: BOS, context, question
        "num_chains": 1,      # chains in the haystack (the first is queried)
        "num_hops": 4,        # assignments after the initial one (a chain names num_hops + 1 variables)
        "digits": 5,          # digits of each chain's value
        "filler": "prose",
        "answer_prefix": "",  # appended to the question after a space: "" (RULER) or e.g. "VAR"
        "max_new_tokens": 30,
    }
    param_specs = {
        "length": ParamSpec(int, low=1, high=1 << 22, description="prompt tokens"),
        "num_chains": ParamSpec(int, low=1, high=1024, description="chains in the haystack"),
        "num_hops": ParamSpec(int, low=0, high=1024, description="assignments after the initial one"),
        "digits": ParamSpec(int, low=1, high=64, description="digits of each chain's value"),
        "filler": ParamSpec(str, choices=KINDS, description="corpus kind of the haystack"),
        "answer_prefix": ParamSpec(str, description="words that start the answer, appended to the question"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated for the answer"),
    }

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        chains_n, hops, length = int(params["num_chains"]), int(params["num_hops"]), int(params["length"])
        where = f"task '{self.name}' item {index}"
        if chains_n < 1 or hops < 1:
            raise StudyError(f"{where}: need num_chains >= 1 and num_hops >= 1; got {chains_n}, {hops}")
        units = filler_units(tokenizer, length, kind=params["filler"], seed=rng.randrange(2 ** 31))
        filler = "".join(units)
        names: set[str] = set()

        def new_name() -> str:
            while True:
                name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
                if name not in names and name not in filler:
                    names.add(name)
                    return name

        chains, values, needles = [], [], []
        for _ in range(chains_n):
            chain = [new_name() for _ in range(hops + 1)]
            value = draw_number(rng, int(params["digits"]), filler, set(values))
            chains.append(chain)
            values.append(value)
            depths = sorted(rng.random() for _ in chain)
            statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
            needles.extend(zip(depths, statements))
        question = QUESTION.format(value=values[0], count=hops + 1)
        if params["answer_prefix"]:
            question += " " + params["answer_prefix"]
        context, tokens = fit_haystack(tokenizer, units, needles, instruction=INSTRUCTION, question=question,
                                       length=length, where=where)
        return TaskItem(task=self.name, id=f"{self.name}-{index}", context=context, question=question,
                        answers=tuple(chains[0]), metric="string_match_all",
                        max_new_tokens=int(params["max_new_tokens"]),
                        meta={"chains": chains, "values": values, "tokens": tokens, "length": length})
