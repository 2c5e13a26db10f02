"""Calibration objectives: the follow-ups a one-layer plan's KL is measured on (``docs/calibration.md``).

Every objective is measured the same way (:mod:`polykv.profiling.endtoend`): a prefix of P tokens is prefilled once,
each one-layer plan's cache is restored from that snapshot and compressed, and only the follow-up tokens run through
it, teacher forced; the metric is ``KL(p_full || p_plan)`` of the next-token distributions at the *scored* follow-up
positions. The objectives differ only in the follow-up (a :class:`FollowUp` each):

- ``continuation`` (metric ``kl``): the corpus sequence's own next tokens, every position scored. Generic text
  depends mostly on recent tokens, so this rewards plans that keep the recent window;
- ``reconstruction`` (metric ``kl_reconstruction``): KVzip's repeat-the-context prompt, built by the registered
  probe rule that reconstructs the context (:func:`reconstruction_rule`; its prompt wording and the chat template's
  assistant header), then one chunk of the
  prefix; chunks are drawn at the start, middle and end of every prefix; the chunk's tokens are scored;
- ``retrieval`` (metric ``kl_retrieval``): synthetic facts (:data:`TEMPLATES`: a locker's item, a depot's count,
  a room's access code, a station's staff member) inserted at depths spread over 0.05..0.95 into a natural
  haystack, then a question about one of them; only the answer's tokens are scored.

Retrieval stays apart from the studies' long-context tasks: its templates share no phrase with any study task's
(passkey, niah, variable tracking: a test compares them), and its haystack is the corpus's *reserved* prose
(:func:`polykv.models.corpus.reserved_text`: docstrings of the standard library's test suites and IDLE, which no
study filler or calibration sequence holds), not the held-out sequences.
"""

from __future__ import annotations

import random
from typing import Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from polykv.errors import ProfileError, StudyError
from polykv.models.corpus import reserved_text
from polykv.profiling.calibrate_settings import tokenizer_params
from polykv.profiling.profile_checks import MIX_METRIC
from polykv.registry import get_registry

OBJECTIVES = ("continuation", "reconstruction", "retrieval")
METRIC_OF = {"continuation": "kl", "reconstruction": "kl_reconstruction", "retrieval": "kl_retrieval"}
"""The profile metric table of each objective."""
DEPTHS = (0.05, 0.95)
"""Range of the depths (fraction of the prefix before the fact) retrieval facts are inserted at."""


@attrs.define(frozen=True, kw_only=True, eq=False)
class FollowUp:
    """One measured item: ``ids`` [P + F] (the prefix, then the follow-up), of which follow-up prediction ``rows``
    are scored (row r predicts ``ids[prefix + 1 + r]``; the prediction of ``ids[prefix]`` comes from the prefill,
    before any layer compresses, and is never scored)."""

    kind: str
    ids: torch.Tensor
    prefix: int
    rows: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    span: tuple[int, int] | None = None
    """Prefix tokens ``[start, end)`` the item is about: the chunk reconstructed, the fact asked for."""
    depth: float | None = None
    """``span[0] / prefix``."""
    answer: str = ""
    """Retrieval: the answer's text (its tokens are the scored ones)."""
    fact: str = ""
    """Retrieval: the sentence inserted at ``span`` (its tokens are those of ``" " + fact + "\n"``)."""

    @property
    def scored_ids(self) -> torch.Tensor:
        """The token ids the scored rows predict."""
        return self.ids[self.prefix + 1 + torch.tensor(self.rows, dtype=torch.long)]


def parse_objectives(names: Sequence[str], weights: Mapping[str, float] | None = None
                     ) -> tuple[tuple[str, ...], dict[str, float]]:
    """Checked objective names (in :data:`OBJECTIVES` order) and their weights by metric table (1.0 unless given)."""
    names = [str(n) for n in names]
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown or not names:
        raise ProfileError(f"objectives {names}: {'unknown ' + repr(unknown) if unknown else 'none given'}; use one "
                           f"or more of {', '.join(OBJECTIVES)} (--objectives)")
    weights = dict(weights or {})
    extra = sorted(set(weights) - set(names))
    if extra:
        raise ProfileError(f"objective weights name {extra}, which are not among the objectives {names}; add them to "
                           f"the objectives or drop their weights (--objectives, --objective-weights)")
    out = {}
    for n in names:
        w = weights.get(n, 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
            raise ProfileError(f"objective weight of {n}: expected a finite number >= 0, got {w!r} "
                               f"(--objective-weights)")
        out[METRIC_OF[n]] = float(w)
    if len(out) > 1 and not any(out.values()):
        raise ProfileError("objective weights are all 0: the mixed routing table would be 0 everywhere; give at "
                           "least one objective a positive weight (--objective-weights)")
    return tuple(n for n in OBJECTIVES if n in names), out


# -- continuation --------------------------------------------------------------------------------------------------

def continuation(sequences: Sequence[torch.Tensor], prefix: int) -> list[FollowUp]:
    """Each sequence's own tokens after ``prefix``, every follow-up position scored."""
    return [FollowUp(kind="continuation", ids=s.view(-1), prefix=prefix, rows=range(s.numel() - prefix - 1))
            for s in sequences]


# -- reconstruction ------------------------------------------------------------------------------------------------

def reconstruction(sequences: Sequence[torch.Tensor], prefix: int, prompt_rule, *, per_sequence: int = 3
                   ) -> list[FollowUp]:
    """Per sequence, ``per_sequence`` chunks spread from the start to the end of its prefix (start, middle, end for
    3), each a follow-up ``prompt + assistant header + chunk`` built by ``prompt_rule.probe_chunks`` (the
    :func:`reconstruction_rule`, with the model's prompt ids); the chunk's tokens are scored."""
    out = []
    for s in sequences:
        ids = s.view(-1)
        chunks = prompt_rule.probe_chunks(ids[:prefix].view(1, -1))
        picks = sorted({round(q * (len(chunks) - 1)) for q in np.linspace(0.0, 1.0, per_sequence)})
        for i in picks:
            chunk = chunks[i]
            follow = chunk.ids[0].to(ids.dtype).cpu()
            start, end = chunk.span
            head = follow.numel() - (end - start)
            out.append(FollowUp(kind="reconstruction", ids=torch.cat([ids[:prefix], follow]), prefix=prefix,
                                rows=range(head - 1, follow.numel() - 1), span=(start, end), depth=start / prefix))
    return out


def reconstruction_rule(registry, tokenizer, chunk_tokens: int):
    """The rule whose probe builds the reconstruction follow-ups for ``tokenizer``: the first registered rule (by name)
    that declares a probe and builds its prompt ids from a tokenizer (KVzip's context reconstruction)."""
    if tokenizer is None:
        raise ProfileError("the reconstruction objective needs the model's tokenizer (its prompt and chat template); "
                           "pass tokenizer= to calibrate, or leave reconstruction out of the objectives")
    probing = [n for n in sorted(registry.names("rule")) if registry.rule(n).declares_probe()]
    params = tokenizer_params(registry, probing, tokenizer)
    if not params:
        raise ProfileError("the reconstruction objective builds its prompt with a registered rule whose probe "
                           "reconstructs the context (KVzip), and none is registered; install one or leave "
                           "reconstruction out of the objectives")
    name = min(params)
    return registry.rule(name)(**params[name], chunk_size=int(chunk_tokens))


# -- retrieval -----------------------------------------------------------------------------------------------------

@attrs.define(frozen=True)
class Template:
    fact: str
    """The sentence inserted into the prefix ({key}, {value})."""
    question: str
    """The question after the prefix, ending where the answer starts ({key})."""
    values: Callable[[random.Random], str]


_LABELS = ("Amber", "Birch", "Cobalt", "Dune", "Ember", "Fjord", "Garnet", "Heron", "Indigo", "Juniper", "Kestrel",
           "Lichen", "Marlin", "Nettle", "Onyx", "Pewter", "Quartz", "Russet", "Sable", "Tamarind", "Umber", "Vellum",
           "Willow", "Yarrow", "Zircon")
_ITEMS = ("a brass compass", "a wool blanket", "a tin lantern", "a clay teapot", "a silk scarf", "a cedar box",
          "a glass marble", "a paper kite", "a copper kettle", "a linen map")
_NAMES = ("Odile Marchetti", "Tobias Lindqvist", "Priya Raghunathan", "Mateo Okonkwo", "Ingrid Haverkamp",
          "Sefa Aydin", "Noemi Castellanos", "Ruairi Doyle", "Hana Takeda", "Lukas Brenner")

TEMPLATES = (
    Template("According to the inventory, locker {key} contains {value}.",
             "\n\nAccording to the inventory, what does locker {key} contain? Locker {key} contains",
             lambda rng: rng.choice(_ITEMS)),
    Template("The logbook shows that depot {key} shipped {value} crates last week.",
             "\n\nHow many crates did depot {key} ship last week? Depot {key} shipped",
             lambda rng: str(rng.randrange(100, 10000))),
    Template("The door of archive room {key} opens with the code {value}.",
             "\n\nWhich code opens the door of archive room {key}? The code is",
             lambda rng: "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + "-"
             + str(rng.randrange(100, 1000))),
    Template("On the rota, station {key} is staffed by {value}.",
             "\n\nWho staffs station {key} on the rota? Station {key} is staffed by",
             lambda rng: rng.choice(_NAMES)),
)
"""The retrieval facts: key-value (an item), a number, a code, a name."""


def haystacks(count: int, prefix: int, tokenize: Callable[[str], Sequence[int]], *, seed: int = 0
              ) -> list[torch.Tensor]:
    """``count`` haystacks of ``prefix`` token ids: consecutive slices of the reserved prose
    (:func:`polykv.models.corpus.reserved_text`, text no study filler holds), drawn with ``seed``."""
    chars = 8 * prefix * count
    while True:
        try:
            text = reserved_text(chars, seed=seed)
        except StudyError as exc:
            raise ProfileError(f"the retrieval objective's haystacks: {exc}") from None
        ids = [int(x) for x in tokenize(text)]
        if len(ids) >= count * prefix:
            return [torch.tensor(ids[i * prefix:(i + 1) * prefix], dtype=torch.long) for i in range(count)]
        chars *= 2


def retrieval(count: int, prefix: int, tokenize: Callable[[str], Sequence[int]], *, seed: int = 0,
              per_sequence: int = 4) -> list[FollowUp]:
    """``count`` haystacks (:func:`haystacks`), each with ``per_sequence`` facts (templates in turn, distinct keys)
    inserted at token depths spread over :data:`DEPTHS` (the prefix stays ``prefix`` tokens: the haystack's end is
    cut), then one item per fact: the prefix with every fact, the fact's question and its answer; the answer's tokens
    are scored."""
    out = []
    for i, s in enumerate(haystacks(count, prefix, tokenize, seed=seed)):
        rng = random.Random(f"polykv-retrieval:{seed}:{i}")
        keys = rng.sample(_LABELS, per_sequence)
        facts = []
        for j, key in enumerate(keys):
            t = TEMPLATES[(i + j) % len(TEMPLATES)]
            value = t.values(rng)
            fact = t.fact.format(key=key, value=value)
            facts.append((t, key, value, fact, [int(x) for x in tokenize(" " + fact + "\n")]))
        inserted = sum(len(f[-1]) for f in facts)
        if inserted >= prefix // 2:
            raise ProfileError(f"the retrieval facts take {inserted} tokens of a {prefix}-token prefix; lengthen the "
                               f"prefix (--prefix) or use fewer facts")
        filler = [int(x) for x in s.view(-1)[:prefix - inserted]]
        spread = np.linspace(DEPTHS[0], DEPTHS[1], per_sequence)
        jitter = (DEPTHS[1] - DEPTHS[0]) / (2 * max(per_sequence - 1, 1))
        depths = [float(np.clip(d + rng.uniform(-jitter, jitter) / 2, *DEPTHS)) for d in spread]
        ids, spans, taken = [], [], 0
        for d, (*_, fact_ids) in zip(depths, facts):
            at = min(len(filler), taken + max(0, round(d * prefix) - len(ids)))  # the fact starts at depth d
            ids += filler[taken:at]
            taken = at
            spans.append((len(ids), len(ids) + len(fact_ids)))
            ids += fact_ids
        ids += filler[taken:]
        head = torch.tensor(ids, dtype=torch.long)
        for (t, key, value, fact, _), span in zip(facts, spans):
            q = [int(x) for x in tokenize(t.question.format(key=key))]
            a = [int(x) for x in tokenize(" " + value)]
            out.append(FollowUp(kind="retrieval", ids=torch.cat([head, torch.tensor(q + a, dtype=torch.long)]),
                                prefix=prefix, rows=range(len(q) - 1, len(q) + len(a) - 1), span=span,
                                depth=span[0] / prefix, answer=value, fact=fact))
    return out


def build(objectives: Sequence[str], sequences: Sequence[torch.Tensor], prefix: int, *, tokenizer=None,
          registry=None, seed: int = 0, chunk_tokens: int = 64) -> dict[str, list[FollowUp]]:
    """``{objective: its follow-ups}`` on the held-out ``sequences`` (each longer than ``prefix`` + 1)."""
    registry = get_registry() if registry is None else registry
    out = {}
    for name in objectives:
        if name == "continuation":
            out[name] = continuation(sequences, prefix)
        elif name == "reconstruction":
            out[name] = reconstruction(sequences, prefix, reconstruction_rule(registry, tokenizer, chunk_tokens))
        elif name == "retrieval":
            if tokenizer is None:
                raise ProfileError("the retrieval objective needs the model's tokenizer (its facts and questions are "
                                   "text); pass tokenizer= to calibrate, or leave retrieval out of the objectives")
            out[name] = retrieval(len(sequences), prefix,
                                  lambda text: tokenizer.encode(text, add_special_tokens=False), seed=seed)
        else:
            parse_objectives([name])
    return out


def describe(name: str, items: Sequence[FollowUp]) -> str:
    """The provenance note of one objective's table."""
    scored = sum(len(i.rows) for i in items)
    what = {"continuation": "the sequences' own next tokens",
            "reconstruction": "repeat-the-context prompt + a prefix chunk at start/middle/end (chunk tokens scored)",
            "retrieval": f"{len(TEMPLATES)} fact templates at depths {DEPTHS[0]}..{DEPTHS[1]} of reserved-prose "
                         f"haystacks, a question, the answer tokens scored"}[name]
    return f"metric {METRIC_OF[name]} ({name}): {len(items)} follow-ups, {scored} scored positions; {what}"


__all__ = ["OBJECTIVES", "METRIC_OF", "MIX_METRIC", "FollowUp", "TEMPLATES", "parse_objectives",
           "continuation", "reconstruction", "retrieval", "reconstruction_rule", "build", "describe"]
