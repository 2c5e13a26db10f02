"""The plan-driven KV cache: one :class:`LayerCache` per decoder layer inside a transformers ``Cache``.

Each layer holds a key store and a value store (:class:`~polykv.operators.KVStore`), the original
position of every stored token per KV head, its rule objects and its signals. A forward runs in two
halves: ``update`` (called by the model right after RoPE) hands the attention function the keys and
values to attend; :meth:`LayerCache.after_attention` (called by the attention function) records
signals, then selects and stores (prefill) or evicts (decode).

Prefill (the first forward on an empty cache, or every chunk of :meth:`Session.prefill`): attention
runs on the raw prompt K/V; after the last chunk the prefill rule keeps ``capacity`` tokens and only
those are appended to the stores (quantization happens after eviction). Decode (every later forward,
one token or many): append to the stores, attend, then evict back to capacity with the decode rule
when storage exceeds capacity + ``decode_slack``.

Shapes: B batch, H query heads, Hkv KV heads, T stored tokens, q new tokens, d head dim.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from polykv.errors import RuntimeConfigError
from polykv.operators import SelectionContext
from polykv.plan import LayerPlan, OpSpec
from polykv.runtime.signals import SignalNeeds, SignalState
from polykv.runtime.stores import new_store


@attrs.define(frozen=True, kw_only=True)
class LayerSpec:
    """Everything a layer cache needs from the session, resolved once per plan layer."""

    plan: LayerPlan
    prefill_rule: Any = None
    """Rule object of the prefill op, or None for ``full``."""
    decode_rule: Any = None
    """Rule object of the decode op, or None for ``full``."""
    prefill_needs: SignalNeeds = SignalNeeds()
    """Signals tracked during prefill (both rules' needs: decode scores start from the prompt)."""
    decode_needs: SignalNeeds = SignalNeeds()
    """Signals tracked after prefill (the decode rule's needs only)."""


class LayerCache(CacheLayerMixin):
    """Cache of one decoder layer under a plan (see the module docstring for the flow)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, *, layer_idx: int, spec: LayerSpec, owner: "PlanCache"):
        super().__init__()
        self.layer_idx, self.spec, self.owner = layer_idx, spec, owner
        self.tokens_seen = 0
        """Tokens processed (= position of the next token), whatever was evicted."""
        self.prefilled = False
        self.key_store = self.value_store = None
        self.positions: torch.Tensor | None = None
        """[B, Hkv, T] int64 original positions of the stored tokens (or of the raw prompt in prefill)."""
        self.signals = SignalState(needs=spec.prefill_needs)
        self._raw_k = self._raw_v = None          # [B, Hkv, T, d] prompt K/V before selection
        self._attend_k = self._attend_v = None    # what ``update`` returned for this forward

    # -- transformers layer interface ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def num_stored(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[-1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_stored() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(layer_idx=self.layer_idx, spec=self.spec, owner=self.owner)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take the q new post-RoPE keys/values [B, Hkv, q, d]; return the K/V to attend."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, Hkv, q, _ = key_states.shape
        pos = torch.arange(self.tokens_seen, self.tokens_seen + q, device=key_states.device)
        pos = pos.view(1, 1, q).expand(B, Hkv, q)
        if self.positions is not None and self.positions.shape[0] != B:
            raise RuntimeConfigError(f"layer {self.layer_idx}: the cache holds a batch of {self.positions.shape[0]} "
                                     f"but this forward has {B}; start a new cache with session.new_cache()")
        self.positions = pos.contiguous() if self.positions is None else torch.cat([self.positions, pos], dim=-1)
        if not self.prefilled:
            self._raw_k = key_states if self._raw_k is None else torch.cat([self._raw_k, key_states], dim=2)
            self._raw_v = value_states if self._raw_v is None else torch.cat([self._raw_v, value_states], dim=2)
            self._attend_k, self._attend_v = self._raw_k, self._raw_v
        else:
            self.key_store.append(key_states)
            self.value_store.append(value_states)
            self._attend_k, self._attend_v = self.key_store.dequantize(), self.value_store.dequantize()
        return self._attend_k, self._attend_v

    # -- after attention -------------------------------------------------------------------------
    def after_attention(self, query: torch.Tensor, scaling: float) -> None:
        """Record signals of the q new queries [B, H, q, d], then select (prefill) or evict (decode)."""
        q = query.shape[2]
        self.signals.observe(query, self._attend_k, scaling, self.tokens_seen)
        self.tokens_seen += q
        try:
            if not self.prefilled:
                if not self.owner.prefill_continues:
                    self._finish_prefill(scaling)
            else:
                self._maybe_evict(scaling)
        finally:
            self._attend_k = self._attend_v = None

    def _finish_prefill(self, scaling: float) -> None:
        spec, k, v = self.spec, self._raw_k, self._raw_v
        cap = spec.plan.prefill.resolve_capacity(self.tokens_seen)
        if spec.prefill_rule is not None and cap is not None and k.shape[2] > cap:
            idx = self._select(spec.prefill_rule, spec.plan.prefill, "prefill", cap, k, v, scaling)
            k, v = _gather_tokens(k, idx), _gather_tokens(v, idx)
        self._raw_k = self._raw_v = None
        held = self.owner.storage_dtype
        self.key_store = new_store(self.owner.registry, spec.plan, "key", dtype=k.dtype, device=k.device,
                                   storage_dtype=held)
        self.value_store = new_store(self.owner.registry, spec.plan, "value", dtype=v.dtype, device=v.device,
                                     storage_dtype=held)
        self.key_store.append(k)
        self.value_store.append(v)
        self.signals.narrow_to(spec.decode_needs)
        self.prefilled = True

    def _maybe_evict(self, scaling: float) -> None:
        spec = self.spec
        if spec.decode_rule is None:
            return
        cap = spec.plan.decode.resolve_capacity(self.tokens_seen)
        if cap is None or self.num_stored() <= cap + self.owner.decode_slack:
            return
        idx = self._select(spec.decode_rule, spec.plan.decode, "decode", cap, self._attend_k, self._attend_v, scaling)
        self.key_store.gather(idx)
        self.value_store.gather(idx)

    def _select(self, rule, op: OpSpec, phase: str, cap: int, keys: torch.Tensor, values: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """Run ``rule`` on the current storage; gather positions and signals; return [B, Hkv, cap] indices."""
        sig, owner = self.signals, self.owner
        ctx = SelectionContext(
            layer_idx=self.layer_idx, phase=phase, keys=keys, positions=self.positions,
            tokens_seen=self.tokens_seen, scaling=scaling, queries=sig.queries,
            query_positions=sig.query_positions, values=values if rule.needs_values else None,
            accumulated=sig.accumulated,
            query_counts=(self.tokens_seen - self.positions) if sig.accumulated is not None else None,
            rope_inv_freq=owner.rope_inv_freq, rope_scaling=owner.rope_scaling,
            model_data=owner.model_data, generator=owner.generator)
        idx = rule.select(ctx, cap)
        B, Hkv, T = self.positions.shape
        if tuple(idx.shape) != (B, Hkv, cap) or idx.dtype != torch.int64:
            raise RuntimeConfigError(
                f"layer {self.layer_idx} ({phase}): rule '{op.rule}' returned indices of shape {tuple(idx.shape)} "
                f"and dtype {idx.dtype}; expected ({B}, {Hkv}, {cap}) int64 (fix the rule's select())")
        if cap > 1 and not bool((idx[..., 1:] > idx[..., :-1]).all() & (idx[..., 0] >= 0).all()
                                & (idx[..., -1] < T).all()):
            raise RuntimeConfigError(f"layer {self.layer_idx} ({phase}): rule '{op.rule}' returned indices that are "
                                     f"not strictly ascending within [0, {T}) (fix the rule's select())")
        self.positions = self.positions.gather(-1, idx)
        sig.gather(idx)
        return idx

    # -- accounting ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Key + value store bytes (codes, scales/zeros, full-precision residuals)."""
        if self.key_store is None:
            return 0
        return int(self.key_store.resident_bytes()) + int(self.value_store.resident_bytes())

    def metadata_bytes(self) -> dict[str, int]:
        """positions int64 [B, Hkv, T] (8 bytes per stored token per KV head) + signal state."""
        pos = self.positions.numel() * 8 if (self.positions is not None and self.prefilled) else 0
        return {"positions": pos, **self.signals.metadata_bytes()}


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, T, d], idx [B, Hkv, k] -> [B, Hkv, k, d]."""
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


class PlanCache(Cache):
    """A transformers ``Cache`` whose layers follow a plan; create it with ``session.new_cache()``."""

    def __init__(self, *, specs: list[LayerSpec], registry, decode_slack: int, rope_inv_freq: torch.Tensor | None,
                 rope_scaling: float, model_data: Mapping[str, Any], generator: torch.Generator | None,
                 storage_dtype: torch.dtype | None = None):
        self.registry, self.decode_slack = registry, decode_slack
        self.storage_dtype = storage_dtype
        """dtype the stores keep K/V, scales and residuals in (None: the compute dtype)."""
        self.rope_inv_freq, self.rope_scaling = rope_inv_freq, rope_scaling
        self.model_data, self.generator = model_data, generator
        self.prefill_continues = False
        """True between the chunks of a chunked prefill (selection waits for the last chunk)."""
        super().__init__(layers=[LayerCache(layer_idx=i, spec=s, owner=self) for i, s in enumerate(specs)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (drives new position ids), not tokens stored."""
        return self.layers[layer_idx].tokens_seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].num_stored()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def stored_tokens(self) -> list[int]:
        """Tokens stored per layer."""
        return [layer.num_stored() for layer in self.layers]

    def _unsupported(self, what: str):
        raise RuntimeConfigError(f"{what} is not supported by the polykv cache (its layers hold different tokens); "
                                 f"use greedy or sampled decoding with one sequence per batch row")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted or speculative decoding)")

    def batch_select_indices(self, indices: torch.Tensor):
        self._unsupported("selecting batch rows")

    def batch_repeat_interleave(self, repeats: int):
        if any(layer.tokens_seen for layer in self.layers):
            self._unsupported("repeating a filled cache's batch rows")
