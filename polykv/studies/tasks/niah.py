"""Needle in a haystack, RULER style: single, multi-key and multi-value.

After Hsieh et al. (2024), "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(``scripts/data/synthetic/niah.py``). Needles read "One of the special magic numbers for {key} is:
{value}."; keys are adjective-noun words, values 7-digit numbers. ``num_keys`` needles carry distinct
keys (the extra ones are distractors), each queried key holds ``num_values`` values, and the question
asks for all values of ``num_queries`` keys; the score is RULER's ``string_match_all``. RULER's
variants map to: single = (1 key, 1 value), multikey = (4 keys, 1 value), multivalue = (1 key, 4 values),
multiquery = (4 keys, 1 value, all 4 asked for: "k1, k2, k3, and k4").
``question="direct"`` asks in passkey style instead ("What is the special magic number for {key}? The special
magic number for {key} is"): RULER's answer prefix ("... mentioned in the provided text are") leads small models
to restate the question instead of answering (SmolLM2-135M does so on most items even with the full cache), so
the direct form is what separates compressed caches on such models; the needles and haystack are the same.
The haystack is real prose from the offline corpus (RULER's "essay" haystack uses Paul Graham essays).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from polykv.errors import StudyError
from polykv.studies.tasks.base import Task, TaskItem, draw_number, filler_units, fit_haystack, param_error
from polykv.models.corpus import KINDS
from polykv.contract.params import ParamSpec

ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "mellow", "noisy", "odd", "proud", "quiet", "rapid", "shy", "tidy", "upbeat", "vivid",
              "wary", "young", "zesty", "bitter", "clever", "damp", "fierce", "glossy", "humble", "loyal")
NOUNS = ("anchor", "badger", "candle", "donkey", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "ladder", "meadow", "napkin", "orchid", "parrot", "quartz", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walnut", "yogurt", "zipper", "beacon", "cactus", "dolphin", "feather", "glacier",
         "hammock", "lantern")
INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat are all the special magic numbers for {query} mentioned in the provided text? "
            "The special magic numbers for {query} mentioned in the provided text are")
DIRECT_QUESTIONS = ("\n\nWhat is the special magic number for {query}? The special magic number for {query} is",
                    "\n\nWhat are all the special magic numbers for {query}? The special magic numbers for {query} "
                    "are")
"""The ``direct`` question, for one answer and for several."""
QUESTION_STYLES = ("ruler", "direct")


def _join(words: list[str]) -> str:
    """RULER's list of queried keys: "k1, k2, k3, and k4"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + ", and " + words[-1]


class NeedleTask(Task):
    """RULER-style needle retrieval with configurable keys, values and queries."""

    name = "niah"
    description = "RULER-style needle in a haystack (keys, values per key and queried keys are parameters)"
    defaults: Mapping[str, Any] = {
        "length": 2048,        # prompt tokens as the runner feeds them: BOS, context, question
        "num_keys": 1,         # needles with distinct keys (queried + distractors)
        "num_values": 1,       # values per queried key
        "num_queries": 1,      # keys asked for (<= num_keys)
        "digits": 7,           # digits of each value
        "filler": "prose",     # corpus kind of the haystack
        "question": "ruler",   # RULER's question, or "direct" (passkey style; see the module docstring)
        "max_new_tokens": 128,
    }
    param_specs = {
        "length": ParamSpec(int, low=1, high=1 << 22, description="prompt tokens"),
        "num_keys": ParamSpec(int, low=1, high=1024, description="needles with distinct keys"),
        "num_values": ParamSpec(int, low=1, high=1024, description="values per queried key"),
        "num_queries": ParamSpec(int, low=1, high=1024, description="keys asked for, at most num_keys"),
        "digits": ParamSpec(int, low=1, high=64, description="digits of each value"),
        "filler": ParamSpec(str, choices=KINDS, description="corpus kind of the haystack"),
        "question": ParamSpec(str, choices=QUESTION_STYLES,
                              description="RULER's question or a direct, passkey-style one"),
        "max_new_tokens": ParamSpec(int, low=1, high=1 << 16, description="tokens generated for the answer"),
    }

    def check_params(self, params: Mapping[str, Any]) -> None:
        if params["num_queries"] > params["num_keys"]:
            raise param_error("num_queries", f"task '{self.name}': num_queries ({params['num_queries']}) must not "
                                             f"exceed num_keys ({params['num_keys']})")

    def make_item(self, tokenizer, index: int, rng: random.Random, params: Mapping[str, Any]) -> TaskItem:
        nk, nv, nq = int(params["num_keys"]), int(params["num_values"]), int(params["num_queries"])
        length = int(params["length"])
        where = f"task '{self.name}' item {index}"
        if nk < 1 or nv < 1 or not 1 <= nq <= nk:
            raise StudyError(f"{where}: need num_keys >= 1, num_values >= 1 and 1 <= num_queries <= num_keys; "
                             f"got {nk}, {nv}, {nq}")
        units = filler_units(tokenizer, length, kind=params["filler"], seed=rng.randrange(2 ** 31))
        filler = "".join(units)
        pool = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
        keys = rng.sample([k for k in pool if k not in filler], nk)
        queries = keys[:nq]
        taken: set[str] = set()
        values: dict[str, list[str]] = {}
        for i, key in enumerate(keys):
            # Distractor keys carry one value each; queried keys carry num_values.
            values[key] = []
            for _ in range(nv if i < nq else 1):
                v = draw_number(rng, int(params["digits"]), filler, taken)
                taken.add(v)
                values[key].append(v)
        needles = [(rng.random(), NEEDLE.format(key=k, value=v)) for k in keys for v in values[k]]
        if params["question"] == "direct":
            template = DIRECT_QUESTIONS[0 if nq * nv == 1 else 1]
        else:
            template = QUESTION
        question = template.format(query=_join(queries))
        context, tokens = fit_haystack(tokenizer, units, needles, instruction=INSTRUCTION, question=question,
                                       length=length, where=where)
        answers = tuple(v for q in queries for v in values[q])
        return TaskItem(task=self.name, id=f"{self.name}-{index}", context=context, question=question,
                        answers=answers, metric="string_match_all", max_new_tokens=int(params["max_new_tokens"]),
                        meta={"keys": keys, "queries": queries, "depths": sorted(d for d, _ in needles),
                              "tokens": tokens, "length": length})


class NeedleSingleTask(NeedleTask):
    """RULER niah_single: one needle, one value."""

    name = "niah_single"
    description = "RULER niah_single: one key, one value, prose haystack"


class NeedleMultiKeyTask(NeedleTask):
    """RULER niah_multikey: four needles with distinct keys, one of them queried."""

    name = "niah_multikey"
    description = "RULER niah_multikey: four keys (three distractors), one value each"
    defaults = {**NeedleTask.defaults, "num_keys": 4}


class NeedleMultiValueTask(NeedleTask):
    """RULER niah_multivalue: one key holding four values, all of them asked for."""

    name = "niah_multivalue"
    description = "RULER niah_multivalue: one key with four values"
    defaults = {**NeedleTask.defaults, "num_values": 4}


class NeedleMultiQueryTask(NeedleTask):
    """RULER niah_multiquery: four needles with distinct keys, all four queried."""

    name = "niah_multiquery"
    description = "RULER niah_multiquery: four keys with one value each, all asked for"
    defaults = {**NeedleTask.defaults, "num_keys": 4, "num_queries": 4}
