"""Rule-owned state: what a retention rule (or an allocator) remembers between forwards.

A rule that needs more than the stored keys declares a state object (:meth:`RetentionRule.new_state`).
The runtime keeps one per layer and op, and calls it in a fixed order:

1. :meth:`RuleState.observe` after every attention forward of the layer, with an
   :class:`Observation` (the new post-RoPE queries, every key they attended, padding, positions);
2. the rule reads it at selection time as ``ctx.state``;
3. :meth:`RuleState.gather` with the layer's :class:`~polykv.contract.selection.Selection` whenever tokens
   are evicted, so per-token state stays aligned with storage (column ``j`` of a state tensor
   describes the token in storage column ``j``; new tokens are appended as the last columns);
4. :meth:`RuleState.reset` when a new cache starts (a fresh state is built per cache, too);
5. :meth:`RuleState.nbytes` is counted in ``session.resident_bytes()`` and predicted by
   :meth:`RuleState.predict_bytes` in the memory model.

The built-in signals are such helpers: :class:`QueryWindow` (the last ``w`` queries, SnapKV, TOVA)
and :class:`AccumulatedAttention` (H2O's running column sums). :class:`CompositeState` combines
several. Everything here computes attention in query chunks: no T x T score matrix is materialised.

A state names what :meth:`RuleState.observe` reads from the forward in ``needs`` (:data:`NEEDS`);
the prefill attention function then computes it in its own pass (:func:`signal_request`,
:class:`AttentionSignals`) and the :class:`Observation` hands it over instead of recomputing.

Shapes: B batch, H query heads, Hkv KV heads, G = H // Hkv, q new queries of one forward, K keys
attended by them (stored + new, padded across heads when the layer is ragged), d head dim.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterator

import attrs
import torch

from polykv.attention.signals import (ATTENTION_INPUT, COLUMN_SUMS, COLUMN_SUMS_PER_HEAD,  # noqa: F401
                                      LAST_ROWS, NEEDS, AttentionSignals, SignalRequest, attention_column_sums,
                                      attention_column_sums_per_head, attention_last_rows, attention_probabilities,
                                      lower_right_causal, signal_request)


@attrs.define(frozen=True, kw_only=True)
class Observation:
    """One attention forward of one layer, as a state sees it."""

    layer_idx: int
    phase: str
    """``"prefill"``, ``"decode"`` or ``"probe"`` (the phase of the forward just run)."""
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
    signals: AttentionSignals | None = None
    """What the attention pass already computed for the states of this layer (None: nothing)."""
    rope_inv_freq: torch.Tensor | None = None
    """[d/2] the model's RoPE inverse frequencies, for states that undo RoPE on ``query`` (None: unknown)."""
    probe: Any = None
    """The :class:`~polykv.contract.probe.ProbeChunk` of a probe forward (``phase == "probe"``: ``query`` holds the
    chunk's queries, ``keys`` the whole prompt's then the chunk's own, ``first_position`` the prompt length);
    None for every prompt and decode forward."""
    attention_input: torch.Tensor | None = None
    """[B, q, D] the hidden states entering the layer's attention module for the q new tokens (the normed input its
    q/k/v projections read), when a state of the layer names :data:`ATTENTION_INPUT` in ``needs``; else None."""
    model_data: Any = None
    """The session's per-model data by key (as ``SelectionContext.model_data``), for states that apply it as they
    observe (kvzap's surrogate); None where the caller has none."""
    _computed: dict = attrs.field(factory=dict, init=False, repr=False, eq=False)

    @property
    def num_new(self) -> int:
        return int(self.query.shape[2])

    def _signal(self, name: str, compute):
        got = None if self.signals is None else getattr(self.signals, name)
        if got is None:
            got = self._computed.get(name)
        if got is None:
            got = self._computed[name] = compute()
        return got

    def column_sums(self) -> torch.Tensor:
        """[B, Hkv, K] float32: this forward's attention summed over its queries and each group's heads.

        Read-only (shared by every state of the layer): copy before changing it in place."""
        return self._signal(COLUMN_SUMS, lambda: attention_column_sums(self.query, self.keys, self.scaling,
                                                                       self.valid))

    def column_sums_per_head(self) -> torch.Tensor:
        """[B, H, K] float32: this forward's attention summed over its queries, per query head (read-only)."""
        return self._signal(COLUMN_SUMS_PER_HEAD, lambda: attention_column_sums_per_head(
            self.query, self.keys, self.scaling, self.valid))

    def precomputed_rows(self, rows: int) -> torch.Tensor | None:
        """[B, H, rows, K] attention rows of the last ``rows`` new queries if the attention pass computed
        them (``rows <= num_new``), else None."""
        got = None if self.signals is None else self.signals.last_rows
        if got is None or rows > got.shape[2] or rows > self.num_new:
            return None
        return got[:, :, got.shape[2] - rows:]

    def last_rows(self, rows: int) -> torch.Tensor:
        """[B, H, rows, K] float32 attention rows of the last ``rows`` (at most ``num_new``) new queries:
        the attention pass's, or computed now (read-only)."""
        rows = min(int(rows), self.num_new)
        got = self.precomputed_rows(rows)
        if got is not None:
            return got
        return attention_last_rows(self.query, self.keys, self.scaling, rows, self.valid)

    def probabilities(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Chunks ``(start, [B, Hkv, G, c, K] float32)`` of this forward's attention rows (always computed)."""
        return attention_probabilities(self.query, self.keys, self.scaling, self.valid)


class RuleState:
    """Base class of rule-owned state (see the module docstring for when each method is called)."""

    share_key: Hashable | None = None
    """States of one layer with equal, non-None keys hold the same thing; the runtime keeps one
    (and a prefill snapshot can hand it to another plan)."""
    metadata_name: str = "rule_state"
    """The key its bytes are reported under in ``session.resident_bytes().metadata_per_layer``."""
    needs: frozenset[str] = frozenset()
    """Signals :meth:`observe` reads from the :class:`Observation` (:data:`COLUMN_SUMS`,
    :data:`COLUMN_SUMS_PER_HEAD`, :data:`LAST_ROWS`): the attention function then computes them in
    its own pass over the prompt, so ``obs.column_sums()`` and the like cost nothing more. A state
    that declares nothing still gets everything, computed when it asks."""
    needed_rows: int = 0
    """With :data:`LAST_ROWS` in ``needs``: how many of the newest attention rows ``observe`` reads."""
    observes_probe: bool = False
    """True: :meth:`observe` also sees the forwards of a probe (:mod:`polykv.contract.probe`); every other
    state sees only the prompt's and decode forwards."""

    def observe(self, obs: Observation) -> None:
        """Record one attention forward; per-token tensors grow by ``obs.num_new`` columns."""

    def gather(self, selection) -> None:
        """Keep the state of the selected columns (``selection.index`` [B, Hkv, K], right-aligned)."""

    def after_prefill(self) -> None:
        """Drop what only prefill needed (called once, after the prefill selection)."""

    def after_decode_step(self) -> None:
        """Drop what only this decode forward needed (called after every decode forward's eviction
        check, so nothing of one step's signals is held between steps)."""

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
    """The last ``window`` post-RoPE queries and their positions (SnapKV's observation window, TOVA's query).

    When every kept query came from this forward (the prompt, or the one query of a decode step for a
    window of 1) it also keeps their attention rows if the attention pass computed them
    (:data:`LAST_ROWS`), so the rule's :meth:`~polykv.contract.rules.SelectionContext.window_attention`
    reads them instead of recomputing; they are dropped at the first eviction, after prefill and
    after every decode step.
    """

    needs = frozenset({LAST_ROWS})

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"a query window needs at least 1 query, got {window}")
        self.window = int(window)
        self.needed_rows = self.window
        self.share_key = ("query_window", self.window)
        self.metadata_name = "query_window"
        self.reset()

    def reset(self) -> None:
        self.queries: torch.Tensor | None = None
        """[B, H, w, d] newest queries (newest last), compute dtype."""
        self.positions: torch.Tensor | None = None
        """[w] int64 positions of ``queries``."""
        self._drop_rows()

    def _drop_rows(self) -> None:
        self.rows: torch.Tensor | None = None
        """[B, H, w, K] float32 attention rows of ``queries`` over the keys of the forward that made them
        (prefill only, from the attention pass), or None."""
        self.row_key_positions: torch.Tensor | None = None
        """[B, Hkv, K] positions of the keys ``rows`` cover."""

    def observe(self, obs: Observation) -> None:
        q, w = obs.num_new, self.window
        if self.queries is None or q >= w:  # this forward's queries fill the window (every decode step of TOVA)
            first = obs.first_position + max(q - w, 0)
            self.queries = obs.query[:, :, -w:].clone()
            self.positions = torch.arange(first, obs.first_position + q, device=obs.query.device)
        else:
            pos = torch.arange(obs.first_position, obs.first_position + q, device=obs.query.device)
            self.queries = torch.cat([self.queries, obs.query], dim=2)[:, :, -w:].contiguous()
            self.positions = torch.cat([self.positions, pos])[-w:]
        self._drop_rows()
        n = self.queries.shape[2]
        if n <= q:  # every kept query came from this forward (a decode step of a one-query window too)
            rows = obs.precomputed_rows(n)
            if rows is not None and rows.untyped_storage().nbytes() > rows.numel() * rows.element_size():
                rows = rows.clone()  # part of a larger slab (another state asked for more rows): hold only ours
            self.rows = rows
            self.row_key_positions = None if rows is None else obs.positions

    def attention_rows(self, queries: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """[B, H, w, K] the kept attention rows if they are those of ``queries`` (this window's own tensor)
        over keys at ``key_positions`` [B, Hkv, K]; else None."""
        if self.rows is None or queries is not self.queries:
            return None
        kept = self.row_key_positions
        if kept.shape != key_positions.shape or not torch.equal(kept, key_positions):
            return None
        return self.rows

    def gather(self, selection) -> None:
        self._drop_rows()

    def after_prefill(self) -> None:
        self._drop_rows()

    def after_decode_step(self) -> None:
        self._drop_rows()

    def nbytes(self) -> int:
        if self.queries is None:
            return 0
        rows = 0 if self.rows is None else self.rows.numel() * 4
        return self.queries.numel() * self.queries.element_size() + self.positions.numel() * 8 + rows

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
    needs = frozenset({COLUMN_SUMS})

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
        # (the runtime reads needs from leaves(); these are the union, for anyone asking the composite)
        self.needs = frozenset().union(*(p.needs for p in self.parts))
        self.needed_rows = max((p.needed_rows for p in self.parts), default=0)
        self.observes_probe = any(p.observes_probe for p in self.parts)

    def observe(self, obs: Observation) -> None:
        for p in self.parts:
            if obs.probe is None or p.observes_probe:
                p.observe(obs)

    def gather(self, selection) -> None:
        for p in self.parts:
            p.gather(selection)

    def after_prefill(self) -> None:
        for p in self.parts:
            p.after_prefill()

    def after_decode_step(self) -> None:
        for p in self.parts:
            p.after_decode_step()

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
