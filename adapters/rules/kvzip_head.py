"""KVzip's context-independent head level (the reference's ``--level head``): rule and allocator ``kvzip-head``.

Each KV head (l, h) has one offline score s[l, h] = max_j S[l, h, j], the largest reconstruction probability
any context token receives from it on one calibration context (:func:`compute_head_scores`, through the
``kvzip`` rule's probe, :mod:`polykv.adapters.rules.kvzip`); a head then keeps or drops its whole context.
"""

from __future__ import annotations

import torch

from polykv.adapters.rules.kvzip import SINKS, KVzipRule, check_sink_capacity, prompt_params
from polykv.contract import (Allocator, ModelDataNeed, RuleState, ScoredRule, SelectionContext, allocators, model_data,
                             param, probe, ragged_top_k)
from polykv.adapters.rules.kvzip_heads import HEAD_SCORES_SUFFIX, HeadScores

HEAD_SCORES_KEY = "kvzip-head"
CALIBRATION_SINK = 4
"""Leading tokens of the calibration context that act as attention sinks (kvpress's ``n_sink``): they join
every softmax and take no part in the head scores' maximum."""


def compute_head_scores(model, token_batches, tokenizer=None, *, run_probe: probe.ProbeRunner | None = None,
                        chunk_size: int = 2048) -> HeadScores:
    """KVzip's head scores s[l, h] = max_j S[l, h, j] from ONE calibration context, through the runtime's probe.

    ``token_batches`` (LongTensor [1, T] each, plain text) are joined into one context; the first
    :data:`CALIBRATION_SINK` tokens are its sinks. The reconstruction probe of rule ``kvzip`` runs over the
    rest (its prompts built from ``tokenizer``: :func:`prompt_params`; else the tokenizer saved beside the
    model) through ``run_probe``, the runtime's probe runner (``polykv.runtime.session.run_probe``, which the
    runtime passes when it computes the data), and the maximum reconstruction probability of each layer and KV
    head over the context is kept.
    """
    if run_probe is None:
        raise model_data.ModelDataError("kvzip head scores are measured through the runtime's probe: pass "
                                        "run_probe=polykv.runtime.session.run_probe")
    tokenizer = tokenizer if tokenizer is not None else model_data.tokenizer_of(model)
    if tokenizer is None:
        raise ValueError("kvzip head scores need the model's tokenizer for the reconstruction prompts; pass "
                         "tokenizer=... (polykv.apply(..., tokenizer=tok) or compute_head_scores(..., tokenizer=tok))")
    ids = torch.cat([b.reshape(1, -1).long() for b in token_batches], dim=1)            # (1, T)
    if ids.shape[1] <= CALIBRATION_SINK:
        raise ValueError(f"the calibration context has {ids.shape[1]} tokens; kvzip head scores need more than "
                         f"{CALIBRATION_SINK}")
    params = dict(prompt_params(tokenizer), chunk_size=int(chunk_size), n_sink=CALIBRATION_SINK,
                  prefix_tokens=CALIBRATION_SINK, sink="tokens")
    states = run_probe(model, "kvzip", params, ids.to(next(model.parameters()).device))
    scores = torch.stack([st.scores[0, :, CALIBRATION_SINK:].amax(dim=-1) for st in states]).float().cpu()
    return HeadScores.measured(scores, model, num_tokens=int(ids.shape[1]) - CALIBRATION_SINK)


HEAD_SCORES = ModelDataNeed(
    key=HEAD_SCORES_KEY, suffix=HEAD_SCORES_SUFFIX, compute=compute_head_scores, load=HeadScores.load,
    check=lambda data, model: data.check_model(model), description="kvzip head scores", takes_tokenizer=True,
    takes_probe=True)
"""What rule ``kvzip-head`` needs measured on the model: computed once over the offline corpus (or by
calibration), saved as ``x.kvzip-heads.safetensors`` beside a profile or in the model-data cache."""


class HeadSinks(RuleState):
    """How many leading prompt tokens every head of a ``kvzip-head`` layer keeps (read by the allocator)."""

    metadata_name = "rule_state"

    def __init__(self, *, sink: str, n_sink: int, prefix_tokens: int):
        self.limit = int(n_sink) if sink == "tokens" else int(prefix_tokens)
        self.share_key = ("kvzip-head-sinks", self.limit)  # observes nothing: a prefill snapshot shares it

    def observe(self, obs) -> None:
        return None

    def nbytes(self) -> int:
        return 0

    def predict_bytes(self, **shape) -> int:
        return 0


class KVzipHeadRule(ScoredRule):
    """KVzip at head level: every context token of KV head (l, h) scores the head's offline score s[l, h].

    No probe runs: the scores come from ``ctx.model_data["kvzip-head"]`` (:class:`HeadScores`, one
    calibration context, :func:`compute_head_scores`). Each head keeps or drops its whole context: in an
    allocation group of allocator ``kvzip-head`` by one threshold over the group's layers x heads (the
    reference), alone by the layer's own threshold over its KV heads within ``capacity`` x Hkv tokens. The
    sink tokens (``n_sink`` leading tokens, or the ``prefix_tokens`` prefix) are kept in every head.

    Parameters
    ----------
    sink : {"tokens", "prefix"}, default "tokens"
        ``"tokens"``: the first ``n_sink`` tokens are kept in every head; ``"prefix"``: the whole
        ``prefix_tokens`` prefix (chat template, system prompt) is (the reference).
    n_sink : int, default 4
    prefix_tokens : int, default 0
    """

    name = "kvzip-head"
    phases = frozenset({"prefill"})
    signal = "none"
    shared_across_heads = False
    model_data_need = HEAD_SCORES
    sink: str = param("tokens", choices=SINKS, description="kept in every head: n_sink tokens or the prefix")
    n_sink: int = param(4, low=0, high=1 << 20, description="attention-sink tokens")
    prefix_tokens: int = param(0, low=0, high=1 << 30, description="prompt tokens before the context")
    paper = KVzipRule.paper

    def check_capacity(self, capacity: int) -> None:
        check_sink_capacity(self.name, self.params, capacity, tokens_kept=True)

    def new_state(self) -> HeadSinks:
        return HeadSinks(sink=self.sink, n_sink=self.n_sink, prefix_tokens=self.prefix_tokens)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """s[l, h] for every stored context token of head h, +inf for the sink tokens: [B, Hkv, T] float32."""
        data = ctx.model_data.get(HEAD_SCORES_KEY)
        if data is None:
            raise ValueError(f"layer {ctx.layer_idx}: rule 'kvzip-head' needs model_data['{HEAD_SCORES_KEY}'] "
                             f"(kvzip head scores of this model)")
        s = data.layer(ctx.layer_idx, ctx.num_kv_heads).to(ctx.keys.device, torch.float32)     # (Hkv,)
        scores = s.view(1, -1, 1).expand(ctx.positions.shape).clone()                           # (B, Hkv, T)
        return scores.masked_fill(ctx.positions < self._sinks(ctx), float("inf"))

    def _sinks(self, ctx) -> int:
        return ctx.state.component(HeadSinks).limit if ctx.state is not None else 0

    def select(self, ctx: SelectionContext, capacity: int):
        """Within an allocation group (``ctx.head_capacity`` set) each head keeps its budget; alone, the layer's
        own threshold over its KV heads keeps whole heads within ``capacity`` x Hkv tokens (:func:`whole_heads`)."""
        if ctx.head_capacity is not None or ctx.valid is not None:
            return super().select(ctx, capacity)
        scores = self.score(ctx)                                                            # (B, Hkv, T)
        B, Hkv, T = scores.shape
        sinks = max(int((ctx.positions[0, 0] < self._sinks(ctx)).sum()), 1)
        counts = whole_heads(ctx.model_data[HEAD_SCORES_KEY].layer(ctx.layer_idx, Hkv).float().cpu(),
                             torch.full((Hkv,), min(sinks, T)), T, int(capacity) * Hkv)
        return ragged_top_k(scores, counts.view(1, Hkv).expand(B, Hkv))


def whole_heads(scores: torch.Tensor, floors: torch.Tensor, T: int, budget: int) -> torch.Tensor:
    """Per head, T tokens or its ``floors`` [m] (sink) tokens: heads in descending ``scores`` [m] keep all T while
    ``budget`` tokens in all hold them; from the first that does not fit on, every head keeps its floor."""
    counts = floors.clone().long()
    room = int(budget) - int(counts.sum())
    for i in torch.argsort(scores, descending=True, stable=True).tolist():
        extra = T - int(counts[i])
        if extra > room:
            break
        counts[i] = T
        room -= extra
    return counts


class KVzipHeadAllocator(Allocator):
    """KVzip's head level: one threshold over the group's layers x KV heads keeps each head's whole context.

    Heads are ranked by their score s[l, h]; in that order each head keeps all its prompt tokens while the
    group's budget (the sum of the member layers' capacities, x Hkv tokens) holds them, and from the first
    head that does not fit on, every head keeps only its sink tokens (at least one). So the plan's
    ``capacity_ratio`` is the reference's ratio (fraction kept; the reference recommends 0.6). Budget left
    below the threshold is not handed out: a head is kept or dropped whole, as in the reference.
    """

    name = "kvzip-head"
    defaults = {}
    paper = KVzipRule.paper
    reads_rule_state = True

    def layer_statistic(self, ctx) -> tuple[torch.Tensor, int]:
        state = ctx.state.component(HeadSinks) if ctx.state is not None else None
        data = ctx.model_data.get(HEAD_SCORES_KEY)
        if state is None or data is None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'kvzip-head' ranks the head scores of rule "
                             f"'kvzip-head', but this layer's prefill rule is not kvzip-head (route the group's "
                             f"layers to it)")
        sinks = int((ctx.positions[0, 0] < state.limit).sum()) if ctx.valid is None else state.limit
        return data.layer(ctx.layer_idx, ctx.num_kv_heads).float().cpu(), sinks

    def bound(self, capacities, context_tokens: int) -> list[int]:
        """A kept head holds its whole context, whatever the group's total."""
        return [int(context_tokens) for _ in capacities]

    def allocate(self, request: allocators.AllocationRequest) -> torch.Tensor:
        scores = torch.stack([s for s, _ in request.statistics])                 # (n, Hkv)
        floors = torch.tensor([max(k, 1) for _, k in request.statistics]).view(-1, 1).expand_as(scores)
        counts = whole_heads(scores.flatten(), floors.flatten(), int(request.context_tokens),
                             int(request.total) * scores.shape[1])
        return counts.view_as(scores)
