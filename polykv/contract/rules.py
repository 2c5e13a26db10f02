"""The retention-rule contract (v2): what a rule plugin implements.

A *retention rule* decides which stored tokens a layer keeps. It never touches the model or the
cache storage: the runtime hands it a :class:`SelectionContext` and the rule returns a
:class:`~polykv.contract.selection.Selection` (kept columns per KV head, ragged counts allowed, an optional
merge of evicted tokens into kept ones), or simply an index tensor. A rule that remembers
something between forwards owns a :class:`~polykv.contract.state.RuleState` (:meth:`RetentionRule.new_state`).
Quantizers and their stores have their own contract (:mod:`polykv.contract.stores`).
Budgets decided at run time come from allocators (:mod:`polykv.contract.allocators`). :class:`ScoredRule` checks
a rule's own scores (:func:`checked_scores`; the expensive checks when :func:`checks_enabled`).

Shapes: B batch, H query heads, Hkv key/value heads, G = H // Hkv, T stored tokens, d head dim.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, ClassVar, Mapping

import attrs
import torch

from polykv.attention.signals import attention_probabilities
from polykv.contract.params import DeclaredParams, ParamError
from polykv.contract.probe import ProbeChunk
from polykv.contract.selection import Selection, ragged_top_k, top_k_sorted
from polykv.contract.state import AccumulatedAttention, QueryWindow, RuleState
from polykv.errors import PluginContractError, RuntimeConfigError

PHASES = ("prefill", "decode")

# What a rule declares it reads (its ``signal`` setting); the default new_state turns it into a built-in
# state, whose ``needs`` name what it reads of each forward's attention (polykv.attention.signals).
SIGNAL_NONE = "none"                      # positions / keys only
SIGNAL_LAST_QUERY = "last_query"          # attention row(s) of the newest query
SIGNAL_WINDOW = "observation_window"      # attention rows of the last `window` queries
SIGNAL_ACCUMULATED = "accumulated_attention"  # running column sums of attention (H2O)
SIGNAL_PREROPE_STATS = "prerope_key_stats"    # offline query statistics per layer (TriAttention)
SIGNALS = (SIGNAL_NONE, SIGNAL_LAST_QUERY, SIGNAL_WINDOW, SIGNAL_ACCUMULATED, SIGNAL_PREROPE_STATS)

CHECK_ENV = "POLYKV_CHECK"
"""Environment variable that turns the expensive checks on (``1``) everywhere."""


def checks_enabled(check: bool | None = None) -> bool:
    """Whether the expensive checks run: ``check`` when given, else ``POLYKV_CHECK`` (``1``/``true``/``yes``)."""
    if check is not None:
        return bool(check)
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def where(layer: int, phase: str, kind: str, name: str) -> str:
    """The head of every contract message: ``layer 3 (decode): rule 'h2o'``."""
    return f"layer {layer} ({phase}): {kind} '{name}'"


@attrs.define(kw_only=True)
class SelectionContext:
    """Everything a rule may read when it selects tokens for one layer.

    ``keys``, ``positions``, ``tokens_seen``, ``scaling`` and ``layer_idx``/``phase`` are always
    set; ``state`` is the rule's own state (:meth:`RetentionRule.new_state`); ``queries`` /
    ``query_positions`` and ``accumulated`` / ``query_counts`` are filled from the built-in helpers
    :class:`~polykv.contract.state.QueryWindow` and :class:`~polykv.contract.state.AccumulatedAttention`
    when the rule's state is (or contains) one. In a ragged layer storage is padded to the longest
    head: ``valid`` marks real tokens, and padding columns sit before each head's tokens.
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
    state: RuleState | None = None
    """The rule's own state for this layer (None when the rule declares none)."""
    valid: torch.Tensor | None = None
    """[B, Hkv, T] bool: False on padding columns of a ragged layer; None when every column is a token."""
    head_capacity: torch.Tensor | None = None
    """[B, Hkv] int64 per-head budgets from a per-head allocator (``capacity`` is then their max), or None."""
    checks: bool = attrs.field(factory=checks_enabled)
    """Run the expensive contract checks on what the rule returns (default: ``POLYKV_CHECK=1`` is set)."""

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def head_lengths(self) -> torch.Tensor:
        """[B, Hkv] int64 tokens stored per head (all ``num_stored`` unless ragged)."""
        B, H, T = self.positions.shape
        if self.valid is None:
            return torch.full((B, H), T, dtype=torch.long, device=self.positions.device)
        return self.valid.sum(-1)

    @property
    def num_stored(self) -> int:
        return self.keys.shape[2]

    def window_attention(self, window: int | None = None) -> torch.Tensor:
        """Softmax attention of the last ``window`` queries over the stored keys: [B, H, w, T] float32.

        Causal: a query at position p sees only stored tokens with position <= p (padding never).
        The rows the prefill attention pass already computed for these queries over these keys
        (kept by the state's :class:`~polykv.contract.state.QueryWindow`) are returned as they are;
        otherwise they are computed in float32 from ``queries`` and ``keys``, the G query heads of a
        KV head folded into the row axis (keys are never repeated), in query chunks.
        """
        if self.queries is None or self.query_positions is None:
            raise ValueError("this context carries no queries; the rule must declare a query signal")
        n = self.queries.shape[2]
        w = n if window is None else min(int(window), n)
        holder = None if self.state is None else self.state.component(QueryWindow)
        kept = None if holder is None else holder.attention_rows(self.queries, self.positions)
        if kept is not None:
            return kept[:, :, n - w:]
        return window_rows(self.queries[:, :, n - w:], self.query_positions[n - w:], self.keys, self.positions,
                           self.scaling)


_WINDOW_CHUNK_ELEMENTS = 1 << 21
"""Float32 logits per query chunk of :func:`window_rows` (8 MiB)."""


def window_rows(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """Softmax attention of ``queries`` [B, H, w, d] at ``query_positions`` [w] over ``keys`` [B, Hkv, T, d]
    at ``positions`` [B, Hkv, T] (-1 = padding): [B, H, w, T] float32, a query seeing positions <= its own.

    The G query heads of a KV head are folded into the row axis (no copy of the keys per head);
    query rows run in chunks of at most 8 MiB of logits.
    """
    B, H, w, _ = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    out = torch.empty(B, Hkv, H // Hkv, w, T, dtype=torch.float32, device=keys.device)
    for start, probs in attention_probabilities(queries, keys, scaling, positions=(query_positions, positions),
                                                chunk_elements=_WINDOW_CHUNK_ELEMENTS):
        out[:, :, :, start:start + probs.shape[3]] = probs                  # (B, Hkv, G, c, T)
    return out.view(B, H, w, T)


class RetentionRule(DeclaredParams):
    """Base class of every retention rule (eviction adapter).

    Subclasses set the class attributes and implement :meth:`select` (or :meth:`score`, when
    deriving from :class:`ScoredRule`). Parameters are keyword arguments declared in
    ``param_specs`` (:class:`polykv.contract.params.ParamSpec` with the reference default; ``defaults`` is
    derived from them, see :class:`polykv.contract.params.DeclaredParams`); unknown parameters are an error.
    Plan validation builds the rule (``cls(**params)``), so checks in ``__init__`` fail when a plan
    is loaded, naming the file, layer and field.
    """

    plugin_kind = "rule"
    name: ClassVar[str]
    phases: ClassVar[frozenset[str]] = frozenset(PHASES)
    signal: ClassVar[str] = SIGNAL_NONE
    needs_values: ClassVar[bool] = False
    shared_across_heads: ClassVar[bool] = False
    """True when one index set serves every KV head of the layer (e.g. TOVA)."""
    reads_rope: ClassVar[bool] = False
    """True when the rule undoes or redoes RoPE on the keys or queries it reads (``ctx.rope_inv_freq``): it
    cannot score a layer that stores key codes (a plan's ``k_rank``), whose keys are not in RoPE coordinates."""
    paper: ClassVar[str] = ""
    tokenizer_params: ClassVar[tuple[str, ...]] = ()
    """Parameters whose values come from the model's tokenizer (KVzip's prompt token ids): those a plan leaves
    unset (null), ``polykv.apply`` fills from :meth:`params_for_tokenizer` with the tokenizer it is given, else the
    one saved beside the model."""

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if cls.signal not in SIGNALS:
            raise TypeError(f"rule {cls.__qualname__}: signal {cls.signal!r} is not one of {list(SIGNALS)}")
        if not isinstance(cls.phases, frozenset) or not cls.phases or not cls.phases <= set(PHASES):
            raise TypeError(f"rule {cls.__qualname__}: phases must be a non-empty frozenset of {list(PHASES)}, "
                            f"got {cls.phases!r}")

    @classmethod
    def params_for_tokenizer(cls, tokenizer: Any) -> dict[str, Any]:
        """The values of :attr:`tokenizer_params` for ``tokenizer`` (the default: none)."""
        return {}

    def check_capacity(self, capacity: int) -> None:
        """Raise a :class:`~polykv.contract.params.ParamError` naming the parameter when these parameters cannot
        serve ``capacity`` tokens per KV head (e.g. more tokens always kept than it holds). Plan validation calls
        it for a capacity in tokens, the runtime for one resolved from a ratio; the default accepts every one."""
        return None

    @classmethod
    def query_window(cls, params: Mapping[str, Any]) -> int:
        """How many recent queries the runtime must keep for this rule (0 when none)."""
        if cls.signal == SIGNAL_LAST_QUERY:
            return 1
        if cls.signal == SIGNAL_WINDOW:
            return int({**cls.defaults, **params}.get("window", 1))
        return 0

    def probe_chunks(self, prompt_ids: torch.Tensor) -> "list[ProbeChunk] | None":
        """The forwards of a model pass after prefill this rule needs (:mod:`polykv.contract.probe`), built
        from the prompt's token ids [B, T]; None (the default): no probe.

        A rule that returns chunks must serve the prefill op only, and its state must declare
        ``observes_probe`` to see the probe's forwards. Raise ``ValueError`` (one line, naming the parameter)
        when the probe cannot be built; the runtime reports it before the model runs.
        """
        return None

    @classmethod
    def declares_probe(cls) -> bool:
        """Whether this rule class overrides :meth:`probe_chunks`."""
        return cls.probe_chunks is not RetentionRule.probe_chunks

    def new_state(self) -> RuleState | None:
        """The state this rule keeps per layer, or None. Called once per layer per new cache.

        The default builds the built-in helper the class's ``signal`` names: a
        :class:`~polykv.contract.state.QueryWindow` of :meth:`query_window` queries, or
        :class:`~polykv.contract.state.AccumulatedAttention`.
        """
        if self.signal == SIGNAL_ACCUMULATED:
            return AccumulatedAttention()
        w = self.query_window(self.params)
        return QueryWindow(w) if w else None

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor | Selection:
        """The tokens to keep: a :class:`~polykv.contract.selection.Selection`, or [B, Hkv, capacity] int64
        indices ascending along the last dim (every head keeps ``capacity``).

        A ragged Selection may give each head its own count; the layer's total (the sum of the
        counts of a batch row) must not exceed ``capacity * Hkv``, and no head more than it stores.
        Called only when some head stores more than ``capacity`` tokens.
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

    def select(self, ctx: SelectionContext, capacity: int) -> torch.Tensor | Selection:
        """Top ``capacity`` per head after protecting (n_first, n_last); per-head budgets and ragged
        storage give a ragged Selection (each head keeps ``min(budget, stored)``).

        The scores must be exactly [B, Hkv, T] ([B, 1, T] when ``shared_across_heads``): anything else
        is a :class:`~polykv.errors.PluginContractError` naming the rule, layer and phase.
        """
        scores = checked_scores(self, self.score(ctx), ctx).float()
        B, Hkv, T = ctx.keys.shape[0], ctx.num_kv_heads, ctx.num_stored
        scores = scores.expand(B, Hkv, T).clone()
        n_first, n_last = self.protected(ctx, capacity)
        if ctx.valid is None and ctx.head_capacity is None:
            n_first, n_last = min(n_first, capacity), min(n_last, max(capacity - n_first, 0))
            if n_first:
                scores[..., :n_first] = math.inf
            if n_last:
                scores[..., T - n_last:] = math.inf
            if ctx.checks:
                check_deciding_scores(self, scores, ctx)
            return top_k_sorted(scores, capacity)
        budget = ctx.head_capacity if ctx.head_capacity is not None else torch.full((B, Hkv), capacity)
        counts = torch.minimum(budget.to(scores.device).long().expand(B, Hkv), ctx.head_lengths())
        if ctx.valid is not None:
            rank = ctx.valid.long().cumsum(-1) - 1                         # rank of a token within its head
            lengths = ctx.valid.sum(-1, keepdim=True)
        else:
            rank = torch.arange(T, device=scores.device).expand(B, Hkv, T)
            lengths = torch.full((B, Hkv, 1), T, device=scores.device)
        first = torch.clamp(counts, max=n_first).unsqueeze(-1)
        last = torch.minimum(torch.full_like(counts, n_last), (counts - first.squeeze(-1)).clamp_min(0)).unsqueeze(-1)
        scores[(rank < first) | (rank >= lengths - last)] = math.inf
        if ctx.valid is not None:
            scores[~ctx.valid] = -math.inf
        if ctx.checks:
            check_deciding_scores(self, scores, ctx)
        return ragged_top_k(scores, counts)


# -- the checks ScoredRule runs on a rule's own scores ----------------------------------------------------
# A rule's ``score()`` must return a float tensor of exactly [B, Hkv, T] (always checked); with the expensive
# checks on, no NaN may sit among the scores that decide. A failure is one PluginContractError line naming the
# layer, the phase and the rule; a selection's check is polykv.contract.selection.checked_selection, and the
# runtime's checks of everything else plugins return live in polykv.runtime.plugin_results.

def checked_scores(rule, scores: Any, ctx) -> torch.Tensor:
    """``rule.score(ctx)`` must be a float tensor of shape exactly [B, Hkv, T] ([B, 1, T] is allowed
    when the rule is ``shared_across_heads``); nothing is broadcast."""
    B, Hkv, T = ctx.positions.shape
    shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else None
    allowed = [(B, Hkv, T)] + ([(B, 1, T)] if getattr(rule, "shared_across_heads", False) else [])
    if shape not in allowed:
        got = f"shape {shape}" if shape is not None else f"a {type(scores).__name__}"
        raise PluginContractError(f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)} score() returned {got}; "
                                  f"expected [B, Hkv, T] = {allowed[0]} (nothing is broadcast; fix the rule's score())")
    if not scores.is_floating_point():
        raise PluginContractError(f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)} score() returned dtype "
                                  f"{scores.dtype}; expected a floating-point [B, Hkv, T] tensor (fix the rule's "
                                  f"score())")
    return scores


def check_deciding_scores(rule, scores: torch.Tensor, ctx) -> None:
    """Expensive: no NaN among the scores that decide (protected columns already +inf, padding -inf)."""
    if bool(torch.isnan(scores).any()):
        bad = torch.isnan(scores).sum().item()
        stored = [t for t in (getattr(ctx, "keys", None), getattr(ctx, "values", None)) if isinstance(t, torch.Tensor)]
        broken = sum(int((~torch.isfinite(t)).sum()) for t in stored)
        if broken:  # the model's own activations overflowed: no rule can score them
            raise RuntimeConfigError(
                f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)}: the model's keys/values hold {broken} "
                f"non-finite value(s) (inf or NaN) before the rule scored them: the model overflows in "
                f"{stored[0].dtype} (Gemma 3 does in float16, without polykv too); load it in torch.bfloat16 or "
                f"torch.float32")
        raise PluginContractError(f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)} score() returned {bad} "
                                  f"NaN score(s) on stored tokens; expected finite scores or +-inf "
                                  f"(fix the rule's score())")


Register = Callable[[type], None]


def registered_rule(name: str) -> type[RetentionRule]:
    """The rule class registered under ``name`` in the process registry, for a rule that wraps another (CaM,
    Ada-KV); an unknown name is a :class:`~polykv.contract.params.ParamError` (``param`` = ``"rule"``) listing
    the registered rules."""
    # the registry imports this package for its hook specifications: it is imported here, when a rule is built
    from polykv.registry import get_registry

    registry = get_registry()
    if not registry.has("rule", name):
        raise ParamError("rule", f"unknown rule {name!r}; available: {registry.names('rule')}")
    return registry.rule(name)
