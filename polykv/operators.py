"""Operator adapter contracts: retention rules and quantizers.

A *retention rule* decides which stored tokens a layer keeps. It never touches the model or the
cache storage: the runtime hands it a :class:`SelectionContext` holding exactly the signal it
declared, and the rule returns indices. A *quantizer* turns a layer's keys or values into a
:class:`KVStore` (codes + scales) that supports append, gather-by-index without requantizing,
dequantization, and an exact byte count that :mod:`polykv.memory` can predict ahead of time.

Shapes: B batch, H query heads, Hkv key/value heads, G = H // Hkv, T stored tokens, d head dim.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping

import attrs
import torch

PHASES = ("prefill", "decode")

# Signals a rule may declare; the runtime computes only what some layer's rule asks for.
SIGNAL_NONE = "none"                      # positions / keys only
SIGNAL_LAST_QUERY = "last_query"          # attention row(s) of the newest query
SIGNAL_WINDOW = "observation_window"      # attention rows of the last `window` queries
SIGNAL_ACCUMULATED = "accumulated_attention"  # running column sums of attention (H2O)
SIGNAL_PREROPE_STATS = "prerope_key_stats"    # offline query statistics per layer (TriAttention)
SIGNALS = (SIGNAL_NONE, SIGNAL_LAST_QUERY, SIGNAL_WINDOW, SIGNAL_ACCUMULATED, SIGNAL_PREROPE_STATS)


@attrs.define(kw_only=True)
class SelectionContext:
    """Everything a rule may read when it selects tokens for one layer.

    The runtime fills the fields the rule's ``signal`` needs; the rest may be None.
    """

    layer_idx: int
    """Index of the decoder layer."""
    phase: str
    """``"prefill"`` or ``"decode"``."""
    keys: torch.Tensor
    """[B, Hkv, T, d] stored post-RoPE keys (dequantized), in storage order."""
    positions: torch.Tensor
    """[B, Hkv, T] original (RoPE) position of every stored token, int64."""
    tokens_seen: int
    """Tokens processed so far in this sequence (= the next token's position)."""
    scaling: float
    """Attention scaling (1/sqrt(d) for most models)."""
    queries: torch.Tensor | None = None
    """[B, H, w, d] post-RoPE queries of the last ``w`` processed tokens (newest last)."""
    query_positions: torch.Tensor | None = None
    """[w] positions of ``queries``."""
    values: torch.Tensor | None = None
    """[B, Hkv, T, d] stored values (dequantized), when the rule asks for them."""
    accumulated: torch.Tensor | None = None
    """[B, Hkv, T] accumulated attention per KV head (summed over the G query heads), float32."""
    query_counts: torch.Tensor | None = None
    """[B, Hkv, T] how many queries could see each stored token (for normalised H2O)."""
    rope_inv_freq: torch.Tensor | None = None
    """[d/2] RoPE inverse frequencies of this layer."""
    rope_scaling: float = 1.0
    """RoPE attention scaling s_f (1.0 for plain RoPE)."""
    model_data: Mapping[str, Any] = attrs.field(factory=dict)
    """Per-model data a rule needs (e.g. TriAttention query statistics), keyed by name."""
    generator: torch.Generator | None = None
    """Seeded generator for rules that draw random numbers."""

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_stored(self) -> int:
        return self.keys.shape[2]

    def window_attention(self, window: int | None = None) -> torch.Tensor:
        """Softmax attention of the last ``window`` queries over the stored keys: [B, H, w, T].

        Causal: a query at position p sees only stored tokens with position <= p. Computed in
        float32 from ``queries`` and ``keys`` (GQA keys are expanded as a view, never stored).
        """
        if self.queries is None or self.query_positions is None:
            raise ValueError("this context carries no queries; the rule must declare a query signal")
        q = self.queries if window is None else self.queries[:, :, -window:]
        qpos = self.query_positions if window is None else self.query_positions[-window:]
        B, H, w, d = q.shape
        Hkv = self.keys.shape[1]
        k = self.keys.float().unsqueeze(2).expand(B, Hkv, H // Hkv, self.num_stored, d).reshape(B, H, -1, d)
        logits = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scaling  # (B, H, w, T)
        pos = self.positions.unsqueeze(2).expand(B, Hkv, H // Hkv, -1).reshape(B, H, 1, -1)
        visible = pos <= qpos.view(1, 1, -1, 1).to(pos.device)
        logits = logits.masked_fill(~visible, float("-inf"))
        return torch.softmax(logits, dim=-1)


class RetentionRule:
    """Base class of every retention rule (eviction adapter).

    Subclasses set the class attributes and implement :meth:`select` (or :meth:`score`, when
    deriving from :class:`ScoredRule`). Parameters are keyword arguments with the reference
    defaults declared in ``defaults``; unknown parameters are an error.
    """

    name: ClassVar[str]
    phases: ClassVar[frozenset[str]] = frozenset(PHASES)
    signal: ClassVar[str] = SIGNAL_NONE
    defaults: ClassVar[Mapping[str, Any]] = {}
    param_specs: ClassVar[Mapping[str, Any]] = {}
    """Parameter name -> :class:`polykv.params.ParamSpec` (type, range or choices); values are checked."""
    needs_values: ClassVar[bool] = False
    shared_across_heads: ClassVar[bool] = False
    """True when one index set serves every KV head of the layer (e.g. TOVA)."""
    paper: ClassVar[str] = ""

    def __init__(self, **params: Any):
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"rule '{self.name}' has no parameter(s) {unknown}; known: {sorted(self.defaults)}"
            )
        from polykv.params import check_params

        check_params(self.param_specs, params, owner=f"rule '{self.name}'")
        self.params = {**self.defaults, **params}

    @classmethod
    def query_window(cls, params: Mapping[str, Any]) -> int:
        """How many recent queries the runtime must keep for this rule (0 when none)."""
        if cls.signal == SIGNAL_LAST_QUERY:
            return 1
        if cls.signal == SIGNAL_WINDOW:
            return int({**cls.defaults, **params}.get("window", 1))
        return 0

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor:
        """Indices of the tokens to keep: [B, Hkv, capacity] int64, ascending along the last dim.

        Called only when ``ctx.num_stored > capacity``.
        """
        raise NotImplementedError


class ScoredRule(RetentionRule):
    """A rule defined by a per-token score; keeps the top ``capacity`` per KV head.

    ``protected(ctx, capacity)`` returns (n_first, n_last): tokens at the start and end of storage
    that are always kept (sinks, recent window); the rest of the budget goes to the highest scores.
    """

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """[B, Hkv, T] (or [B, 1, T] when ``shared_across_heads``) float scores, higher = keep."""
        raise NotImplementedError

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        return 0, 0

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor:
        scores = self.score(ctx).float()
        B, Hkv, T = ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored
        scores = scores.expand(B, Hkv, T).clone()
        n_first, n_last = self.protected(ctx, capacity)
        n_first, n_last = min(n_first, capacity), min(n_last, max(capacity - n_first, 0))
        if n_first:
            scores[..., :n_first] = math.inf
        if n_last:
            scores[..., T - n_last:] = math.inf
        return top_k_sorted(scores, capacity)


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, ascending; ties keep the earlier token."""
    T = scores.shape[-1]
    # A tiny position-dependent tie-breaker makes selection deterministic across devices.
    order = torch.arange(T, device=scores.device, dtype=torch.float64)
    keyed = scores.double() - order * 1e-12 if scores.dtype != torch.float64 else scores - order * 1e-12
    idx = torch.topk(keyed, k, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values


# -- quantizers ----------------------------------------------------------------------------------

class KVStore:
    """Storage of one tensor stream (keys or values) of one layer: [B, Hkv, T, d] logically."""

    def append(self, x: torch.Tensor) -> None:
        """Append [B, Hkv, t, d] new tokens."""
        raise NotImplementedError

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index`` [B, Hkv, k] (ascending); survivors keep their codes and scales."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """[B, Hkv, T, d] tensor in the compute dtype."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Exact bytes held: codes + scales/zeros + full-precision residual (tensor storage only)."""
        raise NotImplementedError


class Quantizer:
    """Base class of quantizers. ``bits`` are the widths it stores; 16 always means passthrough."""

    name: ClassVar[str]
    bits: ClassVar[frozenset[int]]
    defaults: ClassVar[Mapping[str, Any]] = {}
    paper: ClassVar[str] = ""

    def __init__(self, **params: Any):
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"quantizer '{self.name}' has no parameter(s) {unknown}; known: {sorted(self.defaults)}"
            )
        self.params = {**self.defaults, **params}

    def new_store(self, stream: str, bits: int, *, dtype: torch.dtype, device: torch.device | str) -> KVStore:
        """An empty store for ``stream`` ("key" or "value") at ``bits``."""
        raise NotImplementedError

    def predict_bytes(self, stream: str, bits: int, *, batch: int, kv_heads: int, head_dim: int,
                      tokens: int, dtype_bytes: int) -> int:
        """Exact resident bytes of a fresh store after ``tokens`` tokens were appended (in any
        chunking) with no eviction since; ``dtype_bytes`` is the compute dtype's element size."""
        raise NotImplementedError


Register = Callable[[type], None]
