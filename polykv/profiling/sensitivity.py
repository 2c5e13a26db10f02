"""Layer-local sensitivity: MoE-nD's relative L2 error of one layer's attention output under a config.

For a captured sequence of T tokens split into a *prefix* of P tokens and F = T - P *follow-up*
tokens, a config (rule, keep, K bits, V bits) is applied to the layer exactly as the runtime would
after a P-token prefill followed by F more tokens:

1. the rule's ``select`` keeps ``capacity = ceil(keep * P)`` prefix tokens per KV head, from a
   :class:`~polykv.operators.SelectionContext` built as the runtime builds it at the end of prefill
   (the last ``w`` prefix queries, accumulated prefix attention, RoPE frequencies, ``model_data``, a
   seeded generator);
2. the kept prefix K/V are appended to fresh key and value stores of the quantizer (kivi by
   default; 16 bits is the passthrough store), then the follow-up K/V are appended, and the stores
   are dequantized;
3. the F follow-up queries attend, causally, to the compressed prefix plus the follow-up tokens.

Error: ``||o_c - o_full||_F / ||o_full||_F`` over the layer's attention output (before ``o_proj``)
of the follow-up queries, [1, H, F, d], against full precision and no eviction. A selection is
reused across every (K, V) width pair, and each quantized stream is computed once per width.

Several sequences of one length are processed together as batch rows (B); the error is the mean of
the per-sequence relative errors.

Reference: MoE-nD, arXiv 2604.17695 (sensitivity S[l, c]). Shapes: B sequences, H query heads, Hkv
KV heads, P prefix, F follow-up, C kept prefix tokens, d head dim.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from polykv.operators import SelectionContext
from polykv.plan import PASSTHROUGH_BITS
from polykv.profiling.budget import tokens_for_keep
from polykv.profiling.capture import LayerCapture
from polykv.profiling.profile import FULL_RULE, CandidateConfig
from polykv.runtime.signals import attention_column_sums, lower_right_causal
from polykv.runtime.stores import passthrough_store

FULL_SELECTION = None
"""Selection marker for keep 1.0: every prefix token stays."""


@attrs.define(kw_only=True)
class LayerContext:
    """Everything besides the capture that selection and quantization of one layer need."""

    registry: Any
    """Registry the rules and the quantizer come from."""
    quantizer: Any
    """Quantizer object (``registry.quantizer("kivi")(**params)``) for widths below 16."""
    model_data: Mapping[str, Any] = attrs.field(factory=dict)
    """Per-model data of rules (``{"triattention": QueryStats}``)."""
    rope_inv_freq: torch.Tensor | None = None
    """[d/2] RoPE inverse frequencies."""
    rope_scaling: float = 1.0
    seed: int = 0
    """Base seed; each selection draws from ``(seed, layer, rule, capacity)``."""


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed from hashable parts (stable across processes: no Python ``hash``)."""
    import hashlib

    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def select_prefix(cap: LayerCapture, prefix: int, rule_name: str, params: Mapping[str, Any], capacity: int,
                  ctx: LayerContext, *, _acc: dict | None = None) -> torch.Tensor:
    """Indices [B, Hkv, capacity] of the prefix tokens ``rule_name`` keeps, as the runtime selects them.

    ``_acc`` caches the prefix's accumulated attention between calls on the same capture.
    """
    rule_cls = ctx.registry.operator(rule_name)
    rule = rule_cls(**params)
    k, v, q = cap.key[:, :, :prefix], cap.value[:, :, :prefix], cap.query[:, :, :prefix]
    B, Hkv, P, _ = k.shape
    positions = torch.arange(P, device=k.device).view(1, 1, P).expand(B, Hkv, P)
    w = min(int(rule_cls.query_window(rule.params)), P)
    acc = counts = None
    if rule_cls.signal == "accumulated_attention":
        if _acc is not None and "acc" in _acc:
            acc = _acc["acc"]
        else:
            acc = attention_column_sums(q, k, cap.scaling)                       # (B, Hkv, P)
            if _acc is not None:
                _acc["acc"] = acc
        counts = P - positions
    gen = torch.Generator(device=k.device)
    gen.manual_seed(derived_seed(ctx.seed, cap.layer_idx, rule_name, capacity))
    sel = SelectionContext(
        layer_idx=cap.layer_idx, phase="prefill", keys=k, positions=positions, tokens_seen=P, scaling=cap.scaling,
        queries=q[:, :, P - w:] if w else None,
        query_positions=torch.arange(P - w, P, device=k.device) if w else None,
        values=v if rule.needs_values else None, accumulated=acc, query_counts=counts,
        rope_inv_freq=None if ctx.rope_inv_freq is None else ctx.rope_inv_freq.to(k.device),
        rope_scaling=ctx.rope_scaling, model_data=ctx.model_data, generator=gen)
    idx = rule.select(sel, capacity)
    if tuple(idx.shape) != (B, Hkv, capacity):
        raise ValueError(f"layer {cap.layer_idx}: rule '{rule_name}' returned indices of shape {tuple(idx.shape)}, "
                         f"expected {(B, Hkv, capacity)} (fix the rule's select())")
    return idx


def gather_tokens(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """x [B, Hkv, P, d], idx [B, Hkv, C] (or None = all) -> [B, Hkv, C, d]."""
    if idx is None:
        return x
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def stored_stream(prefix_kept: torch.Tensor, follow: torch.Tensor, stream: str, bits: int,
                  quantizer: Any) -> torch.Tensor:
    """What a store of ``bits`` returns after the kept prefix, then the follow-up tokens, are appended.

    Parameters
    ----------
    prefix_kept : [B, Hkv, C, d]
    follow : [B, Hkv, F, d]

    Returns
    -------
    [B, Hkv, C + F, d] dequantized tensor in the inputs' dtype.
    """
    kw = dict(dtype=prefix_kept.dtype, device=prefix_kept.device)
    store = passthrough_store(**kw) if bits == PASSTHROUGH_BITS else quantizer.new_store(stream, bits, **kw)
    store.append(prefix_kept)
    store.append(follow)
    return store.dequantize()


def followup_output(cap: LayerCapture, prefix: int, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [B, H, F, d] of the follow-up queries over ``keys``/``values`` [B, Hkv, C + F, d].

    ``mask`` is :func:`followup_mask` for these shapes (built here when not given); attention runs in
    SDPA with the G query heads of each KV head folded into the query axis, as in the runtime.
    """
    q = cap.query[:, :, prefix:]                                                # (B, H, F, d)
    B, H, Fq, d = q.shape
    Hkv, K = keys.shape[1], keys.shape[2]
    if mask is None:
        mask = followup_mask(Fq, K, H // Hkv, q.device)
    qg = q.reshape(B, Hkv, (H // Hkv) * Fq, d)                                  # (B, Hkv, G*F, d)
    out = F.scaled_dot_product_attention(qg, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                         scale=cap.scaling)
    return out.view(B, H, Fq, -1)


def followup_mask(follow: int, keys: int, group: int, device: torch.device) -> torch.Tensor:
    """[G*F, K] bool: the F follow-up queries are the last F of the K keys, repeated for G heads."""
    return lower_right_causal(follow, keys, device).repeat(group, 1)


def relative_error(out: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor | None = None) -> float:
    """Mean over sequences (batch rows) of ``||out_b - ref_b||_F / ||ref_b||_F``; ``out``, ``ref`` [B, ...]."""
    denom = _row_norms(ref) if ref_norm is None else ref_norm
    if bool((denom == 0).any()):
        raise ValueError("the reference attention output is all zeros; the relative error is undefined")
    return float((_row_norms(out - ref) / denom).mean())


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """[B] float64 Frobenius norm of each batch row of ``x`` [B, ...]."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=-1).double()


def _selection_key(c: CandidateConfig, prefix: int) -> tuple:
    if c.keeps_everything:
        return (FULL_RULE, prefix, "{}")
    import json

    return (c.rule, tokens_for_keep(c.keep, prefix), json.dumps(c.params, sort_keys=True))


@torch.no_grad()
def layer_l2(cap: LayerCapture, prefix: int, configs: Sequence[CandidateConfig], ctx: LayerContext, *,
             reference: torch.Tensor | None = None) -> list[float]:
    """Relative L2 error of every config on one captured layer (module docstring); one value per config.

    The capture may hold B sequences of one length (batch rows); the error is the mean over rows.
    """
    T = cap.num_tokens
    if not 0 < prefix < T:
        raise ValueError(f"layer {cap.layer_idx}: prefix {prefix} must lie strictly inside the {T}-token sequence")
    k_follow, v_follow = cap.key[:, :, prefix:], cap.value[:, :, prefix:]
    ref = reference if reference is not None else full_reference(cap, prefix)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(_selection_key(c, prefix), []).append(i)
    out = [float("nan")] * len(configs)
    acc_cache: dict = {}
    ref_norm = _row_norms(ref)
    G, Fq = cap.query.shape[1] // cap.key.shape[1], T - prefix
    for (rule, capacity, _), members in groups.items():
        c0 = configs[members[0]]
        idx = FULL_SELECTION if rule == FULL_RULE or capacity >= prefix else select_prefix(
            cap, prefix, rule, c0.params, capacity, ctx, _acc=acc_cache)
        k_kept, v_kept = gather_tokens(cap.key[:, :, :prefix], idx), gather_tokens(cap.value[:, :, :prefix], idx)
        mask = followup_mask(Fq, k_kept.shape[2] + Fq, G, k_kept.device)
        keys: dict[int, torch.Tensor] = {}
        vals: dict[int, torch.Tensor] = {}
        for i in members:
            c = configs[i]
            if c.k_bits not in keys:
                keys[c.k_bits] = stored_stream(k_kept, k_follow, "key", c.k_bits, ctx.quantizer)
            if c.v_bits not in vals:
                vals[c.v_bits] = stored_stream(v_kept, v_follow, "value", c.v_bits, ctx.quantizer)
            o = followup_output(cap, prefix, keys[c.k_bits], vals[c.v_bits], mask)
            out[i] = relative_error(o, ref, ref_norm)
    return out


def full_reference(cap: LayerCapture, prefix: int) -> torch.Tensor:
    """[B, H, F, d] follow-up attention output with every token at full precision."""
    return followup_output(cap, prefix, cap.key, cap.value)
