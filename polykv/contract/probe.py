"""A model pass after prefill ("probe"): token ids a rule builds from the prompt, run through the model
against the uncompressed prompt cache before any layer selects.

A rule declares a probe by overriding :meth:`~polykv.contract.rules.RetentionRule.probe_chunks`: given
the prompt's token ids it returns the :class:`ProbeChunk` forwards to run (KVzip: "repeat the previous
context" + one chunk of the context). The runtime then holds every layer's prompt unselected after the
last prefill forward, runs each chunk as one forward whose queries attend [the whole prompt | the
chunk's own causal keys], lets the states that declare ``observes_probe`` observe it
(:class:`~polykv.contract.state.Observation` with ``phase == "probe"`` and ``probe`` set), discards the
chunk's keys and values (they never enter the stores, and positions and ``tokens_seen`` stay those of
the prompt), and only then lets every layer select. The cost is the chunks' tokens as extra forward
tokens (:func:`probe_tokens`).

A probe state whose record is a function of the forward's attention logits may compute the attention itself,
so that the logits are formed once: a state with a method ``attend_probe(query, keys, values, scaling, probe,
first_position)`` (query [B, H, n, d], keys and values [B, Hkv, T + n, d] post-RoPE, the chunk's own last)
returns the forward's softmax attention output [B, H, n, dv] and records what it reads meanwhile. The runtime
hands it the probe forwards of full-attention layers with plain softmax and no padding (the first such state
of a layer attends; the others observe as usual); its :meth:`observe` still follows.

Per-model data measured through a probe (KVzip's head scores) cannot import the runtime that runs it: a
:class:`~polykv.contract.model_data.ModelDataNeed` with ``takes_probe`` gets the runtime's :data:`ProbeRunner`
as ``run_probe=`` from whoever computes it.

Shapes: B batch, T prompt tokens, n tokens of one probe chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch


@attrs.define(frozen=True, kw_only=True, eq=False)
class ProbeChunk:
    """One forward of a probe."""

    ids: torch.Tensor
    """[B, n] int64 token ids the model runs, at positions T .. T + n - 1 (after the prompt)."""
    span: tuple[int, int] = (0, 0)
    """Prompt tokens ``[start, end)`` this chunk is about (KVzip: the context chunk it reconstructs)."""
    index: int = 0
    """Position of the chunk in the probe (0 first)."""

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[-1])


def probe_tokens(chunks) -> int:
    """Extra forward tokens per batch row a probe costs: the sum of its chunks' lengths."""
    return sum(c.num_tokens for c in chunks)


def same_probe(a, b) -> bool:
    """Whether two probes (lists of :class:`ProbeChunk`) run the same forwards (one pass serves both)."""
    return len(a) == len(b) and all(x.span == y.span and x.ids.shape == y.ids.shape and torch.equal(x.ids, y.ids)
                                    for x, y in zip(a, b))


ProbeRunner = Callable[[Any, str, dict, torch.Tensor], list]
"""``run_probe(model, rule, params, ids)``: run ``ids`` [1, T] through ``model`` under a plan whose every layer's
prefill is ``rule`` with ``params`` keeping all T tokens, through the runtime's own prompt forward and probe;
returns each layer's prefill rule state (in layer order) as the probe left it (nothing was selected). The runtime
provides it (``polykv.runtime.session.run_probe``) to the compute of per-model data that declares
``takes_probe``."""
