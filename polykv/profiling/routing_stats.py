"""PolyKV's routing statistics per layer: cosine per rule at a common capacity, attention entropy.

PolyKV (arXiv 2606.15157) profiles every candidate rule at one calibration capacity (256 tokens)
and ranks rules per layer by a statistic ``g``; capacities may be split by the layer's attention
entropy. Both are measured here layer-locally on captured sequences (prefix P, follow-up F; several sequences are batch rows and
every statistic is their mean):

- ``cosine[l, r]``: cosine similarity between the layer's mean output hidden state over the
  follow-up tokens with every prefix token kept and with rule r keeping ``capacity`` prefix tokens
  (16 bits). The output hidden state is the attention block's output, after ``o_proj``
  ([hidden]); the residual stream is left out because it would push every cosine towards 1.
- ``entropy[l]``: mean over query heads and follow-up queries of the Shannon entropy (nats) of the
  causal attention distribution over all T keys.

The third PolyKV statistic, delta-PPL when only layer l uses rule r, needs the whole model and is
measured with the runtime in :mod:`polykv.profiling.validation`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from polykv.profiling.capture import LayerCapture
from polykv.profiling.sensitivity import LayerContext, PrefixRun, followup_through_storage, full_reference
from polykv.attention.signals import lower_right_causal

STAT_CAPACITY = 256
"""PolyKV's common calibration capacity (tokens)."""


def mean_hidden(cap: LayerCapture, out: torch.Tensor) -> torch.Tensor:
    """Mean over follow-up tokens of the attention block output: [B, hidden] float64.

    ``out`` is the attention output [B, H, F, d]; it goes through the layer's ``o_proj`` when it has one.
    """
    B, H, F, d = out.shape
    flat = out.transpose(1, 2).reshape(B, F, H * d)                            # (B, F, H*d)
    if cap.o_proj is not None:
        flat = cap.o_proj(flat.to(cap.o_proj.weight.dtype))                     # (B, F, hidden)
    return flat.double().mean(dim=1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the cosine similarity of ``a`` and ``b`` [B, n] (a pair of zero rows counts 1.0)."""
    na, nb = torch.linalg.vector_norm(a, dim=-1), torch.linalg.vector_norm(b, dim=-1)
    cos = (a * b).sum(dim=-1) / (na * nb).clamp_min(torch.finfo(torch.float64).tiny)
    cos = torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos)
    return float(cos.mean())


@torch.no_grad()
def rule_cosines(cap: LayerCapture, prefix: int, rules: Sequence[str], ctx: LayerContext, *,
                 capacity: int = STAT_CAPACITY, reference: torch.Tensor | None = None) -> list[float]:
    """``cosine[l, r]`` of each rule in ``rules`` (module docstring); rules run with their defaults."""
    if capacity >= prefix:
        raise ValueError(f"layer {cap.layer_idx}: the statistics capacity ({capacity}) must be below the prefix "
                         f"length ({prefix}) or every rule keeps everything; lengthen the calibration sequences")
    ref = reference if reference is not None else full_reference(cap, prefix)
    full = mean_hidden(cap, ref)
    out = []
    for rule in rules:
        kept = PrefixRun(cap, prefix, rule, ctx.rule_params.get(rule, {}), ctx).select(capacity)
        out.append(cosine(full, mean_hidden(cap, followup_through_storage(cap, prefix, kept, 16, 16, ctx))))
    return out


@torch.no_grad()
def attention_entropy(cap: LayerCapture, prefix: int) -> float:
    """Mean (over sequences too) entropy (nats) of the follow-up queries' causal attention over all keys (module docstring)."""
    q = cap.query[:, :, prefix:].float()                                        # (B, H, F, d)
    B, H, F, d = q.shape
    Hkv, T = cap.key.shape[1], cap.key.shape[2]
    k = cap.key.float().unsqueeze(2).expand(B, Hkv, H // Hkv, T, d).reshape(B, H, T, d)
    logits = torch.matmul(q, k.transpose(-1, -2)) * cap.scaling                 # (B, H, F, T)
    logits = logits.masked_fill(~lower_right_causal(F, T, q.device), float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(dim=-1)        # (B, H, F)
    return float(ent.double().mean())
