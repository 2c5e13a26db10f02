"""Layer-local sensitivity: MoE-nD's relative L2 error of one layer's attention output under a config.

For a captured sequence of T tokens split into a *prefix* of P tokens and F = T - P *follow-up*
tokens, a config (rule, keep, K bits, V bits) is applied to the layer exactly as the runtime applies
it after a P-token prefill followed by F more tokens, through the runtime's own code:

1. the runtime's layer of a one-rule plan layer (:func:`polykv.runtime.layers.build_layer`) takes the prefix
   K/V and its queries (:func:`~polykv.runtime.layers.observe_prompt`), so the rule's state observes the prefix
   as in a real prefill;
2. the runtime's prefill selection (:meth:`LayerCache.select_prompt`) runs the rule with
   ``capacity = ceil(keep * P)`` (ragged heads and merges included, checked as the runtime checks
   them) from a seeded generator;
3. the selected prefix fills the runtime's stores of the config's widths (:func:`~polykv.runtime.layers.new_storage`)
   (the quantizer's stores; 16 bits is passthrough), the follow-up K/V are appended, and the F
   follow-up queries attend the stored view with the runtime's attention (:func:`polykv.attention.kernels.sdpa`,
   padding of ragged heads masked).

Any registered rule, third-party included, is therefore profiled without re-implementation.
Error: ``||o_c - o_full||_F / ||o_full||_F`` over the layer's attention output (before ``o_proj``)
of the follow-up queries, [B, H, F, d], against full precision and no eviction. A rule's prefix
observation is shared by every capacity, and a selection by every (K, V) width pair.

Several sequences of one length are processed together as batch rows (B); the error is the mean of
the per-sequence relative errors.

Reference: MoE-nD, arXiv 2604.17695 (sensitivity S[l, c]). Shapes: B sequences, H query heads, Hkv
KV heads, P prefix, F follow-up, C kept prefix tokens, d head dim.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import attrs
import torch

from polykv.plan import FULL_OP, LayerPlan, OpSpec
from polykv.profiling.budget import tokens_for_keep
from polykv.profiling.capture import LayerCapture
from polykv.profiling.profile import CandidateConfig
from polykv.profiling.profile_checks import FULL_RULE
from polykv.attention.kernels import sdpa
from polykv.errors import ProfileError
from polykv.runtime.layers import build_layer, new_storage, observe_prompt
from polykv.runtime.storage import StorageView

@attrs.define(kw_only=True)
class LayerContext:
    """Everything besides the capture that selection and quantization of one layer need."""

    registry: Any
    """Registry the rules and the quantizer come from."""
    quantizer: Any
    """Quantizer object (``registry.quantizer("kivi")(**params)``) for widths below 16."""
    quantizer_name: str = attrs.field(default=attrs.Factory(lambda self: self.quantizer.name, takes_self=True))
    """Its registered name (the plan layer's ``quantizer``)."""
    model_data: Mapping[str, Any] = attrs.field(factory=dict)
    """Per-model data the rules declared (:mod:`polykv.contract.model_data`), by key."""
    rope_inv_freq: torch.Tensor | None = None
    """[d/2] RoPE inverse frequencies."""
    rope_scaling: float = 1.0
    seed: int = 0
    """Base seed; each selection draws from ``(seed, layer, rule, capacity)``."""
    rule_params: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    """Parameters of rules given by name (the statistics measured per rule run them with these)."""
    prefills: Any = None
    """``prefills(layer, rule, params)`` -> the :class:`~polykv.runtime.fork.LayerSnapshot` of the runtime's
    uncompressed prefill of the captured prefixes (batch rows in order), its probe included: what a rule that
    runs a probe (:mod:`polykv.contract.probe`) selects from. None: such rules are refused."""


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed from hashable parts (stable across processes: no Python ``hash``)."""
    import hashlib

    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class PrefixRun:
    """One rule's prefill over a captured prefix, ready to select at any capacity (runtime code throughout)."""

    def __init__(self, cap: LayerCapture, prefix: int, rule_name: str, params: Mapping[str, Any], ctx: LayerContext):
        self.cap, self.prefix, self.rule_name, self.ctx = cap, prefix, rule_name, ctx
        op = OpSpec(rule=rule_name, capacity=1, params=dict(params))
        lp = LayerPlan(layer=cap.layer_idx, prefill=op, decode=FULL_OP)
        inv = None if ctx.rope_inv_freq is None else ctx.rope_inv_freq.to(cap.key.device)
        self.generator = torch.Generator(device=cap.key.device)
        """Reseeded before each selection (:meth:`select`)."""
        layer = self.layer = build_layer(lp, ctx.registry, model_data=ctx.model_data, rope_inv_freq=inv,
                                         rope_scaling=ctx.rope_scaling, generator=self.generator)
        if layer.spec.prefill_rule.declares_probe():
            self._from_prefill(layer, rule_name, params)
        else:  # selection waits for select()
            hidden = None if cap.attention_input is None else cap.attention_input[:, :prefix]
            observe_prompt(layer, cap.key[:, :, :prefix], cap.value[:, :, :prefix], cap.query[:, :, :prefix],
                           cap.scaling, hidden)
        self._prompt, self._states = layer.prompt, layer.states

    def _from_prefill(self, layer, rule_name: str, params) -> None:
        """A probe rule's state observed the probe, which only a model pass runs: take the layer's raw prefix
        and the rule's state from the runtime's prefill (:attr:`LayerContext.prefills`), as
        :func:`polykv.runtime.fork.restore_prefill` does."""
        if self.ctx.prefills is None:
            raise ProfileError(f"layer {self.cap.layer_idx}: rule '{rule_name}' runs a probe (a model pass after the "
                               f"prompt), which a captured layer cannot replay; calibrate it with calibrate(), which "
                               f"prefills the prefixes through the runtime, or leave it out")
        snap = self.ctx.prefills(self.cap.layer_idx, rule_name, dict(params))
        if snap.keys.shape[:3] != self.cap.key[:, :, :self.prefix].shape[:3]:
            raise ProfileError(f"layer {self.cap.layer_idx}: the prefill of rule '{rule_name}' holds keys "
                               f"{list(snap.keys.shape)} but the captured prefix is "
                               f"{list(self.cap.key[:, :, :self.prefix].shape)}; prefill the same prefixes")
        layer.lazy_initialization(snap.keys, snap.values)
        layer.tokens_seen = snap.tokens_seen
        layer.states = {phase: None if st is None else copy.deepcopy(snap.states[st.share_key])
                        for phase, st in layer.states.items()}
        layer.prompt = StorageView(keys=snap.keys, values=snap.values, positions=snap.positions, valid=None)

    def select(self, capacity: int) -> StorageView:
        """The prefix as the runtime stores it after selecting ``capacity`` tokens per head (merges applied)."""
        layer = self.layer
        layer.prompt, layer.states = self._prompt, copy.deepcopy(self._states)
        self.generator.manual_seed(derived_seed(self.ctx.seed, self.cap.layer_idx, self.rule_name, capacity))
        layer.select_prompt(capacity)
        return layer.prompt


def followup_through_storage(cap: LayerCapture, prefix: int, kept: StorageView, k_bits: int, v_bits: int,
                             ctx: LayerContext) -> torch.Tensor:
    """[B, H, F, d] attention of the follow-up queries over ``kept`` stored at (``k_bits``, ``v_bits``),
    then the follow-up tokens appended: the runtime's storage and attention."""
    lp = LayerPlan(layer=cap.layer_idx, k_bits=k_bits, v_bits=v_bits, quantizer=ctx.quantizer_name,
                   quantizer_params=dict(ctx.quantizer.params))
    dtype, device = cap.key.dtype, cap.key.device
    storage = new_storage(lp, ctx.registry, dtype=dtype, device=device)
    storage.fill(kept.keys, kept.values, kept.positions, None if kept.valid is None else kept.valid.sum(-1))
    storage.append(cap.key[:, :, prefix:], cap.value[:, :, prefix:], prefix)  # the follow-up at prefix ..
    view = storage.view()
    q = cap.query[:, :, prefix:]
    return sdpa(q, view.keys.to(q.dtype), view.values.to(q.dtype), cap.scaling, view.valid)


def relative_error(out: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor | None = None) -> float:
    """Mean over sequences (batch rows) of ``||out_b - ref_b||_F / ||ref_b||_F``; ``out``, ``ref`` [B, ...]."""
    denom = _row_norms(ref) if ref_norm is None else ref_norm
    if bool((denom == 0).any()):
        raise ValueError("the reference attention output is all zeros; the relative error is undefined")
    return float((_row_norms(out - ref) / denom).mean())


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """[B] float64 Frobenius norm of each batch row of ``x`` [B, ...]."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=-1).double()


def _whole_prefix(cap: LayerCapture, prefix: int) -> StorageView:
    B, Hkv = cap.key.shape[:2]
    pos = torch.arange(prefix, device=cap.key.device).view(1, 1, prefix).expand(B, Hkv, prefix)
    return StorageView(keys=cap.key[:, :, :prefix], values=cap.value[:, :, :prefix], positions=pos, valid=None)


@torch.no_grad()
def layer_l2(cap: LayerCapture, prefix: int, configs: Sequence[CandidateConfig], ctx: LayerContext, *,
             reference: torch.Tensor | None = None, tick=None, heads: list | None = None) -> list[float]:
    """Relative L2 error of every config on one captured layer (module docstring); one value per config.

    The capture may hold B sequences of one length (batch rows); the error is the mean over rows.
    ``tick``, when given, is called after each config (a progress bar). ``heads``, when given (a list), receives
    one row per config: the relative error of each KV head's query group alone, what the config costs when only
    that KV head's tokens are compressed (a query head reads its own KV head only), [C][Hkv].
    """
    import json

    T = cap.num_tokens
    if not 0 < prefix < T:
        raise ValueError(f"layer {cap.layer_idx}: prefix {prefix} must lie strictly inside the {T}-token sequence")
    ref = reference if reference is not None else full_reference(cap, prefix)
    ref_norm = _row_norms(ref)
    Hkv = cap.key.shape[1]
    groups = lambda x: x.reshape(x.shape[0], Hkv, -1, *x.shape[2:])  # noqa: E731  [B, Hkv, H/Hkv, F, d]
    head_refs = [groups(ref)[:, h] for h in range(Hkv)] if heads is not None else []
    head_norms = [_row_norms(r) for r in head_refs]
    out = [float("nan")] * len(configs)
    runs: dict[tuple, PrefixRun] = {}
    selections: dict[tuple, StorageView] = {}
    for i, c in enumerate(configs):
        capacity = prefix if c.keeps_everything else tokens_for_keep(c.keep, prefix)
        if c.keeps_everything or capacity >= prefix:
            key = (FULL_RULE,)
            if key not in selections:
                selections[key] = _whole_prefix(cap, prefix)
        else:
            rule_key = (c.rule, json.dumps(c.params, sort_keys=True))
            key = rule_key + (capacity,)
            if key not in selections:
                if rule_key not in runs:
                    runs[rule_key] = PrefixRun(cap, prefix, c.rule, c.params, ctx)
                selections[key] = runs[rule_key].select(capacity)
        o = followup_through_storage(cap, prefix, selections[key], c.k_bits, c.v_bits, ctx)
        out[i] = relative_error(o, ref, ref_norm)
        if heads is not None:
            heads.append([relative_error(groups(o)[:, h], r, n) for h, (r, n) in enumerate(zip(head_refs, head_norms))])
        if tick is not None:
            tick()
    return out


def full_reference(cap: LayerCapture, prefix: int) -> torch.Tensor:
    """[B, H, F, d] follow-up attention output with every token at full precision."""
    q = cap.query[:, :, prefix:]
    return sdpa(q, cap.key.to(q.dtype), cap.value.to(q.dtype), cap.scaling)
