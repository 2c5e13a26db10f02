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

Shapes: B batch, T prompt tokens, n tokens of one probe chunk.
"""

from __future__ import annotations

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


_PROBE_RUNNER = None


def set_probe_runner(runner) -> None:
    """The runtime installs the function :func:`run_probe` delegates to (the contract cannot import it)."""
    global _PROBE_RUNNER
    _PROBE_RUNNER = runner


def run_probe(model, rule: str, params: dict, ids: torch.Tensor) -> list:
    """Run ``ids`` [1, T] through ``model`` under a plan whose every layer's prefill is ``rule`` with
    ``params`` keeping all T tokens, through the runtime's own prompt forward and probe; returns each layer's
    prefill rule state (in layer order) as the probe left it (nothing was selected). Per-model data measured
    through a probe (KVzip's head scores) is computed with it."""
    if _PROBE_RUNNER is None:
        raise RuntimeError("the polykv runtime is not loaded: import polykv before computing data through a probe")
    return _PROBE_RUNNER(model, rule, params, ids)
