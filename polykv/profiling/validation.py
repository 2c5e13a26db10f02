"""Whole-model checks through the real runtime: KL validation of the L2 proxy, and PolyKV's delta-PPL.

A *one-layer plan* keeps everything at 16 bits on every layer but one, where a config runs in the
prefill phase. It is executed with :func:`polykv.apply` on a held-out sequence: the first P tokens
are prefilled (selection and quantization happen there), then the F follow-up tokens are fed through
the compressed cache in one forward. The F next-token distributions (predicting tokens P .. T-1)
are compared with the uncompressed model's:

- ``kl``: mean over positions of KL(p_full || p_config) in nats (MoE-nD validates its L2
  sensitivity against this, reporting per-layer Pearson 0.945 and Spearman 0.937);
- ``delta_ppl``: perplexity of the follow-up tokens under the plan minus under the full model
  (PolyKV's per-(layer, rule) statistic at the common capacity, 256 tokens).

Shapes: T = P + F tokens, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from polykv.errors import StudyError
from polykv.plan import DEFAULT_QUANTIZER, FULL_OP, OpSpec, full_plan
from polykv.profiling.profile import CandidateConfig
from polykv.profiling.stats import pearson, spearman
from polykv.runtime import apply


def one_layer_plan(geometry, layer: int, *, rule: str, k_bits: int = 16, v_bits: int = 16,
                   capacity: int | None = None, keep: float | None = None, params: Mapping[str, Any] | None = None,
                   quantizer: str = DEFAULT_QUANTIZER, quantizer_params: Mapping[str, Any] | None = None):
    """A full plan except ``layer``, whose prefill op is ``rule`` at ``capacity`` tokens or ``keep`` ratio."""
    if keep is not None and keep >= 1.0:
        op = FULL_OP
    else:
        op = OpSpec(rule=rule, capacity=capacity, capacity_ratio=None if capacity is not None else keep,
                    params=dict(params or {}))
    return full_plan(geometry).with_layer(layer, prefill=op, k_bits=k_bits, v_bits=v_bits, quantizer=quantizer,
                                          quantizer_params=dict(quantizer_params or {}))


def config_plan(geometry, layer: int, config: CandidateConfig, *, quantizer: str = DEFAULT_QUANTIZER,
                quantizer_params: Mapping[str, Any] | None = None):
    """The one-layer plan of a profile config (measured in the prefill phase, as calibration does)."""
    return one_layer_plan(geometry, layer, rule=config.rule, keep=config.keep, params=config.params,
                          k_bits=config.k_bits, v_bits=config.v_bits, quantizer=quantizer,
                          quantizer_params=quantizer_params)


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """[F, V] float64 log-probabilities of the uncompressed model predicting tokens ``prefix`` .. T-1."""
    ids = ids.view(1, -1).to(next(model.parameters()).device)
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0, prefix - 1:]   # (F, V)
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def plan_logprobs(model, plan, ids: torch.Tensor, prefix: int, *, model_data: Mapping[str, Any] | None = None,
                  seed: int = 0) -> torch.Tensor:
    """[F, V] float64 log-probabilities under ``plan``: prefill ``prefix`` tokens, then the follow-up."""
    ids = ids.view(1, -1).to(next(model.parameters()).device)
    with apply(model, plan, model_data=model_data, seed=seed) as session:
        first = session.prefill(ids[:, :prefix]).logits[:, -1:]                     # (1, 1, V)
        rest = model(input_ids=ids[:, prefix:-1], use_cache=True,
                     **{session.cache_keyword: session.cache}).logits                      # (1, F-1, V)
    return torch.log_softmax(torch.cat([first, rest], dim=1)[0].double(), dim=-1)


def kl_divergence(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other); both [F, V] log-probabilities."""
    return float((ref.exp() * (ref - other)).sum(dim=-1).mean())


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of ``targets`` [F] under ``logprobs`` [F, V]."""
    nll = -logprobs.gather(-1, targets.view(-1, 1).to(logprobs.device)).mean()
    return math.exp(float(nll))


def sample_configs(configs: Sequence[CandidateConfig], count: int, seed: int) -> list[int]:
    """``count`` config columns drawn with ``seed`` (the identity config excluded), in column order.

    The same columns serve every layer, so the measured KL forms one [L, count] table.
    """
    pool = [i for i, c in enumerate(configs) if not (c.keeps_everything and c.k_bits == 16 and c.v_bits == 16)]
    if count >= len(pool):
        return pool
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(len(pool), size=count, replace=False))


def correlations(l2: np.ndarray, kl: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """Per-layer (Pearson, Spearman) between the L2 proxy and KL over the sampled configs: [L, 2].

    Uses :func:`polykv.profiling.stats.pearson` / :func:`~polykv.profiling.stats.spearman`; a layer whose
    values are constant on one side gets NaN (the correlation is undefined there).
    """
    out = np.full((l2.shape[0], 2), np.nan)
    for layer in range(l2.shape[0]):
        for j, fn in enumerate((pearson, spearman)):
            try:
                out[layer, j] = fn(l2[layer], kl[layer], permutations=1, seed=seed).r
            except StudyError:
                pass
    return out
