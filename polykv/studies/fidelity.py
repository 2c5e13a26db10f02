"""Continuation fidelity: teacher-force a reference text through a cache, compare with the full cache.

The measure is the one PolyKV's and MoE-nD's calibration signals (KL divergence and perplexity change
of a compressed cache against the full one) approximate, computed directly on held-out text, plus the
top-1 agreement of the two next-token distributions.

Positions. The continuation ``c`` [1, n] follows the context. The prediction of ``c[0]`` comes from the
last prefill forward, which attends to the raw context before anything is evicted, so it is the same
for every policy and tells nothing about the compressed cache; it is left out. The runner feeds
``c[:, :n-1]`` through the session's compressed cache (decode phase: the decode rule may evict, with
its slack, between forwards) and scores the ``m = n - 1`` next-token distributions that predict
``c[1:]``:

* ``kl``: mean over positions of KL(full || policy) in nats, from float32 log-probabilities;
* ``top1``: fraction of positions where the policy's argmax equals the full cache's;
* ``ppl``: exp of the mean negative log-likelihood of ``c[1:]`` (``ppl_full`` for the full cache).

Memory: the full cache's log-probabilities of one item are held as one [m, V] float32 tensor
(:class:`Reference`); a policy is compared ``chunk`` positions at a time ([chunk, V] temporaries).
"""

from __future__ import annotations

import math
from typing import Iterator

import attrs
import torch

from polykv.errors import StudyError
from polykv.runtime.fork import forward

FORCE_CHUNK = 1
"""Continuation tokens per decode forward: 1 is exactly what greedy generation of that text would see."""


@attrs.define(frozen=True)
class Reference:
    """The full cache's next-token distributions over one continuation."""

    logprobs: torch.Tensor
    """[m, V] float32 log-probabilities at the m scored positions."""
    top1: torch.Tensor
    """[m] int64 argmax token of each position."""
    nll: float
    """Mean negative log-likelihood (nats) of the reference tokens ``c[1:]``."""

    @property
    def positions(self) -> int:
        return int(self.logprobs.shape[0])


@attrs.define(frozen=True)
class Fidelity:
    """Per-item continuation metrics of one policy against the :class:`Reference`."""

    kl: float
    """Mean KL(full || policy) over positions, nats."""
    kl_max: float
    """Largest per-position KL, nats."""
    top1: float
    """Fraction of positions whose argmax equals the full cache's."""
    ppl: float
    """Policy perplexity of the reference continuation."""
    ppl_full: float
    """Full-cache perplexity of the same positions."""
    positions: int

    def as_record(self) -> dict[str, float | int]:
        return {"kl": self.kl, "kl_max": self.kl_max, "top1": self.top1, "ppl": self.ppl,
                "ppl_full": self.ppl_full, "positions": self.positions}


def _check(tokens: torch.Tensor, where: str) -> int:
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise StudyError(f"{where}: expected continuation tokens of shape [1, n], got {tuple(tokens.shape)}")
    n = int(tokens.shape[1])
    if n < 2:
        raise StudyError(f"{where}: the continuation has {n} token(s); fidelity scores positions 1..n-1, so it "
                         "needs at least 2 (raise the task's continuation_tokens)")
    return n


def forced_logprobs(session, tokens: torch.Tensor, *, chunk: int = FORCE_CHUNK,
                    where: str = "continuation") -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``tokens[:, :-1]`` through ``session``'s live cache; yield ``(start, logprobs)`` per forward.

    Parameters
    ----------
    session
        An active :class:`polykv.runtime.Session` whose cache holds the compressed context.
    tokens : torch.Tensor
        [1, n] int64 continuation tokens.
    chunk : int
        Tokens per forward.

    Yields
    ------
    start : int
        Index of the first scored position of this forward.
    logprobs : torch.Tensor
        [c, V] float32 log-probabilities predicting ``tokens[0, start + 1 : start + 1 + c]``.
    """
    n = _check(tokens, where)
    if chunk < 1:
        raise StudyError(f"{where}: chunk must be a positive number of tokens, got {chunk}")
    for start in range(0, n - 1, chunk):
        out = forward(session, tokens[:, start:min(start + chunk, n - 1)])
        yield start, torch.log_softmax(out.logits[0].float(), dim=-1)          # (c, V)


def reference(session, tokens: torch.Tensor, *, chunk: int = FORCE_CHUNK, where: str = "continuation") -> Reference:
    """The full cache's :class:`Reference` for ``tokens`` [1, n] (``session`` runs the full plan)."""
    n = _check(tokens, where)
    target = tokens[0, 1:]                                                     # (m,)
    logprobs = None
    for start, lp in forced_logprobs(session, tokens, chunk=chunk, where=where):
        if logprobs is None:
            logprobs = torch.empty(n - 1, lp.shape[-1], dtype=torch.float32, device=lp.device)
        logprobs[start:start + lp.shape[0]] = lp
    nll = -logprobs.gather(1, target[:, None].to(logprobs.device)).mean()
    return Reference(logprobs=logprobs, top1=logprobs.argmax(-1), nll=float(nll))


def compare(session, tokens: torch.Tensor, ref: Reference, *, chunk: int = FORCE_CHUNK,
            where: str = "continuation") -> Fidelity:
    """Teacher-force ``tokens`` [1, n] through ``session``'s compressed cache; metrics against ``ref``."""
    n = _check(tokens, where)
    if ref.positions != n - 1:
        raise StudyError(f"{where}: the reference scores {ref.positions} positions but the continuation has "
                         f"{n - 1}; compute the reference from the same tokens")
    target = tokens[0, 1:]
    kl_sum = kl_max = agree = nll = 0.0
    for start, lp in forced_logprobs(session, tokens, chunk=chunk, where=where):
        c = lp.shape[0]
        ref_lp = ref.logprobs[start:start + c].to(lp.device)                  # (c, V)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0.0)            # (c,)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += float((lp.argmax(-1) == ref.top1[start:start + c].to(lp.device)).sum())
        nll -= float(lp.gather(1, target[start:start + c, None].to(lp.device)).sum())
    m = n - 1
    return Fidelity(kl=kl_sum / m, kl_max=kl_max, top1=agree / m, ppl=math.exp(nll / m),
                    ppl_full=math.exp(ref.nll), positions=m)


def of_reference(ref: Reference) -> Fidelity:
    """The full cache scored against itself: KL 0, agreement 1, its own perplexity."""
    ppl = math.exp(ref.nll)
    return Fidelity(kl=0.0, kl_max=0.0, top1=1.0, ppl=ppl, ppl_full=ppl, positions=ref.positions)
