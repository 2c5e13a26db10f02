"""Rule-owned state: what a retention rule (or an allocator) remembers between forwards.

A rule that needs more than the stored keys declares a state object (:meth:`RetentionRule.new_state`).
The runtime keeps one per layer and op, and calls it in a fixed order:

1. :meth:`RuleState.observe` after every attention forward of the layer, with an
   :class:`Observation` (the new post-RoPE queries, every key they attended, padding, positions);
2. the rule reads it at selection time as ``ctx.state``;
3. :meth:`RuleState.gather` with the layer's :class:`~polykv.selection.Selection` whenever tokens
   are evicted, so per-token state stays aligned with storage (column ``j`` of a state tensor
   describes the token in storage column ``j``; new tokens are appended as the last columns);
4. :meth:`RuleState.reset` when a new cache starts (a fresh state is built per cache, too);
5. :meth:`RuleState.nbytes` is counted in ``session.resident_bytes()`` and predicted by
   :meth:`RuleState.predict_bytes` in the memory model.

The built-in signals are such helpers: :class:`QueryWindow` (the last ``w`` queries, SnapKV, TOVA)
and :class:`AccumulatedAttention` (H2O's running column sums). :class:`CompositeState` combines
several. Everything here computes attention in query chunks: no T x T score matrix is materialised.

Shapes: B batch, H query heads, Hkv KV heads, G = H // Hkv, q new queries of one forward, K keys
attended by them (stored + new, padded across heads when the layer is ragged), d head dim.
"""

from __future__ import annotations

from typing import Hashable, Iterator

import attrs
import torch

_CHUNK_ELEMENTS = 1 << 21
"""Float32 logits per query chunk (8 MiB)."""


def lower_right_causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool mask: the q new queries are the last q of the k keys (True = may attend)."""
    rows = torch.arange(q, device=device).unsqueeze(1) + (k - q)
    return torch.arange(k, device=device).unsqueeze(0) <= rows


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, scaling: float,
                            valid: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Softmax attention of the q new queries over ``key``, one query chunk at a time.

    Parameters
    ----------
    query : [B, H, q, d]
        Post-RoPE queries of the new tokens (the last q of the K keys).
    key : [B, Hkv, K, d]
        Keys they attend (stored + new), unrepeated.
    valid : [B, Hkv, K] bool, optional
        False on padding columns of a ragged layer; they get probability 0.

    Yields
    ------
    (start, probs) with probs [B, Hkv, G, c, K] float32 for query rows ``start .. start + c``.
    """
    B, H, q, d = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = H // Hkv
    kt = key.float().transpose(-1, -2).unsqueeze(2)                         # (B, Hkv, 1, d, K)
    rows = max(1, _CHUNK_ELEMENTS // max(1, B * H * K))
    qg = query.view(B, Hkv, G, q, d)
    pad = None if valid is None else ~valid.view(B, Hkv, 1, 1, K)
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        logits = torch.matmul(qg[:, :, :, start:stop].float(), kt) * scaling  # (B, Hkv, G, c, K)
        if q > 1:
            logits.masked_fill_(~lower_right_causal(q, K, key.device)[start:stop], float("-inf"))
        if pad is not None:
            logits.masked_fill_(pad, float("-inf"))
        yield start, torch.softmax(logits, dim=-1)
        del logits


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of every new query summed over queries and the G heads of each KV head.

    Returns [B, Hkv, K] float32 (see :func:`attention_probabilities` for the arguments).
    """
    B, Hkv, K = key.shape[0], key.shape[1], key.shape[2]
    out = torch.zeros(B, Hkv, K, dtype=torch.float32, device=key.device)
    for _, probs in attention_probabilities(query, key, scaling, valid):
        out += probs.sum(dim=(2, 3))
    return out


@attrs.define(frozen=True, kw_only=True)
class Observation:
    """One attention forward of one layer, as a state sees it."""

    layer_idx: int
    phase: str
    """``"prefill"`` or ``"decode"`` (the phase of the forward just run)."""
    query: torch.Tensor
    """[B, H, q, d] post-RoPE queries of the q new tokens."""
    keys: torch.Tensor
    """[B, Hkv, K, d] post-RoPE keys they attended (stored + new; the new ones are the last q columns)."""
    positions: torch.Tensor
    """[B, Hkv, K] int64 original positions of ``keys`` (-1 on padding)."""
    valid: torch.Tensor | None
    """[B, Hkv, K] bool, False on padding columns of a ragged layer; None when every column is a token."""
    first_position: int
    """Position of the first new token (tokens seen before this forward)."""
    scaling: float
    """Attention scaling."""

    @property
    def num_new(self) -> int:
        return int(self.query.shape[2])

    def column_sums(self) -> torch.Tensor:
        """[B, Hkv, K] float32: this forward's attention summed over its queries and each group's heads."""
        return attention_column_sums(self.query, self.keys, self.scaling, self.valid)

    def probabilities(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Chunks ``(start, [B, Hkv, G, c, K] float32)`` of this forward's attention rows."""
        return attention_probabilities(self.query, self.keys, self.scaling, self.valid)


class RuleState:
    """Base class of rule-owned state (see the module docstring for when each method is called)."""

    share_key: Hashable | None = None
    """States of one layer with equal, non-None keys hold the same thing; the runtime keeps one
    (and a prefill snapshot can hand it to another plan)."""
    metadata_name: str = "rule_state"
    """The key its bytes are reported under in ``session.resident_bytes().metadata_per_layer``."""

    def observe(self, obs: Observation) -> None:
        """Record one attention forward; per-token tensors grow by ``obs.num_new`` columns."""

    def gather(self, selection) -> None:
        """Keep the state of the selected columns (``selection.index`` [B, Hkv, K], right-aligned)."""

    def after_prefill(self) -> None:
        """Drop what only prefill needed (called once, after the prefill selection)."""

    def reset(self) -> None:
        """Forget everything (a new sequence starts)."""

    def nbytes(self) -> int:
        """Bytes of tensors held."""
        return 0

    def predict_bytes(self, *, batch: int, kv_heads: int, heads: int | None, head_dim: int, tokens: int,
                      context_tokens: int, dtype_bytes: int) -> int | None:
        """Bytes :meth:`nbytes` reports right after a ``context_tokens`` prefill that kept ``tokens``
        tokens per KV head (the most any head kept, for a ragged layer). None = unknown (e.g. the
        query head count ``heads`` is needed but not given)."""
        return 0

    def component(self, cls: type) -> "RuleState | None":
        """This state if it is a ``cls``, else None (:class:`CompositeState` searches its parts)."""
        return self if isinstance(self, cls) else None

    def leaves(self) -> list["RuleState"]:
        """The states that hold tensors (itself; a :class:`CompositeState` lists its parts')."""
        return [self]


def state_bytes(states) -> dict[str, int]:
    """Bytes per ``metadata_name`` over ``states`` (None entries and shared objects counted once)."""
    seen, out = [], {"accumulated": 0, "query_window": 0}
    for st in states:
        for leaf in ([] if st is None else st.leaves()):
            if any(leaf is o for o in seen):
                continue
            seen.append(leaf)
            out[leaf.metadata_name] = out.get(leaf.metadata_name, 0) + int(leaf.nbytes())
    return out


class QueryWindow(RuleState):
    """The last ``window`` post-RoPE queries and their positions (SnapKV's observation window, TOVA's query)."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"a query window needs at least 1 query, got {window}")
        self.window = int(window)
        self.share_key = ("query_window", self.window)
        self.metadata_name = "query_window"
        self.reset()

    def reset(self) -> None:
        self.queries: torch.Tensor | None = None
        """[B, H, w, d] newest queries (newest last), compute dtype."""
        self.positions: torch.Tensor | None = None
        """[w] int64 positions of ``queries``."""

    def observe(self, obs: Observation) -> None:
        q, w = obs.num_new, self.window
        pos = torch.arange(obs.first_position, obs.first_position + q, device=obs.query.device)
        if self.queries is None:
            self.queries, self.positions = obs.query[:, :, -w:].clone(), pos[-w:]
        else:
            self.queries = torch.cat([self.queries, obs.query], dim=2)[:, :, -w:].contiguous()
            self.positions = torch.cat([self.positions, pos])[-w:]

    def nbytes(self) -> int:
        if self.queries is None:
            return 0
        return self.queries.numel() * self.queries.element_size() + self.positions.numel() * 8

    def predict_bytes(self, *, batch, kv_heads, heads, head_dim, tokens, context_tokens, dtype_bytes) -> int | None:
        w = min(self.window, context_tokens)
        return None if heads is None else batch * int(heads) * w * head_dim * dtype_bytes + 8 * w


class AccumulatedAttention(RuleState):
    """H2O's accumulated attention: for every stored token, the attention it received so far.

    ``sums`` [B, Hkv, T] float32 adds, at every forward, each new query's softmax probability
    summed over the G query heads of the KV head; ``query_counts`` says how many queries could see
    each stored token (for normalised variants).
    """

    share_key = "accumulated_attention"
    metadata_name = "accumulated"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None
        self.tokens_seen = 0

    def observe(self, obs: Observation) -> None:
        q, K = obs.num_new, obs.keys.shape[2]
        sums = obs.column_sums()
        if self.sums is None:
            self.sums = sums
        else:
            if self.sums.shape[-1] != K - q:
                raise AssertionError(f"accumulated attention covers {self.sums.shape[-1]} tokens, expected {K - q}")
            self.sums = torch.nn.functional.pad(self.sums, (0, q)) + sums
        self.tokens_seen = obs.first_position + q

    def gather(self, selection) -> None:
        if self.sums is not None:
            self.sums = self.sums.gather(-1, selection.index)

    def query_counts(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, T]: queries that could see each stored token at ``positions``."""
        return self.tokens_seen - positions

    def nbytes(self) -> int:
        return 0 if self.sums is None else self.sums.numel() * 4

    def predict_bytes(self, *, batch, kv_heads, heads, head_dim, tokens, context_tokens, dtype_bytes) -> int:
        return 4 * batch * kv_heads * tokens


class CompositeState(RuleState):
    """Several states observed, gathered and counted together; ``parts`` keeps their order."""

    def __init__(self, *parts: RuleState):
        self.parts = tuple(parts)
        keys = tuple(p.share_key for p in self.parts)
        self.share_key = None if None in keys else ("composite",) + keys

    def observe(self, obs: Observation) -> None:
        for p in self.parts:
            p.observe(obs)

    def gather(self, selection) -> None:
        for p in self.parts:
            p.gather(selection)

    def after_prefill(self) -> None:
        for p in self.parts:
            p.after_prefill()

    def reset(self) -> None:
        for p in self.parts:
            p.reset()

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def predict_bytes(self, **shape) -> int | None:
        got = [p.predict_bytes(**shape) for p in self.parts]
        return None if None in got else sum(got)

    def leaves(self) -> list[RuleState]:
        return [leaf for p in self.parts for leaf in p.leaves()]

    def component(self, cls: type) -> RuleState | None:
        for p in self.parts:
            found = p.component(cls)
            if found is not None:
                return found
        return None
