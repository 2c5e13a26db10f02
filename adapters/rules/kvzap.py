"""KVzap: query-agnostic eviction by a learned per-token surrogate of KVzip's scores (rule and allocator ``kvzap``).

Jégou & Jeblick, "KVzap" (arXiv:2601.07891); kvpress ``KVzapPress`` (kvzap_press.py), ``DMSPress`` (its threshold
mode), ``kvzap/train.py``. Each token's predicted log KVzip score, in every KV head, comes from the token alone:
the hidden state entering the layer's attention with it (:mod:`polykv.adapters.rules.kvzap_model`): no probe, no
query, one small regressor per layer with one output per KV head. It is computed once per token, when the layer
sees it (the rule's state keeps it, aligned with storage), and never rescored.
"""

from __future__ import annotations

import math

import attrs
import torch

from polykv.adapters.rules.kvzap_model import KVZAP_SUFFIX, SURROGATES, KVzapSurrogate, is_kvzap_file
from polykv.adapters.rules.kvzap_train import train_kvzap
from polykv.adapters.rules.kvzip import KVzipAllocator
from polykv.contract import (PHASES, ModelDataNeed, ParamError, RuleState, ScoredRule, SelectionContext, param,
                             state as states)
from polykv.errors import RuntimeConfigError

KVZAP_KEY = "kvzap"

SURROGATE_NEED = ModelDataNeed(
    key=KVZAP_KEY, suffix=KVZAP_SUFFIX, compute=train_kvzap, load=KVzapSurrogate.load,
    check=lambda data, model: data.check_model(model), recognise=is_kvzap_file, description="kvzap surrogate",
    takes_tokenizer=True, takes_probe=True)
"""What rule ``kvzap`` needs trained on the model: ``polykv model-data MODEL kvzap -o FILE`` trains it (beside a
profile as ``x.kvzap.safetensors``); missing, the runtime trains one over the offline corpus and caches it."""


class PredictedScores(RuleState):
    """The predicted log-score of every stored token ([B, Hkv, T] float32): each forward's new tokens are predicted
    as the layer sees them, from the hidden states entering its attention (``Observation.attention_input``, the
    need :data:`~polykv.contract.state.ATTENTION_INPUT`), then follow the stored tokens."""

    metadata_name = "rule_state"
    needs = frozenset({states.ATTENTION_INPUT})

    def __init__(self, surrogate: str, protect: tuple[int, int] = (0, 0)):
        self.surrogate, self.protect = surrogate, (int(protect[0]), int(protect[1]))
        """Which regressor predicts; (sinks, window) the rule keeps in every head (the allocator ranks them first)."""
        self.share_key = ("kvzap-scores", surrogate, self.protect)
        self.reset()

    def reset(self) -> None:
        self.scores: torch.Tensor | None = None

    def observe(self, obs) -> None:
        B, Hkv, K = obs.keys.shape[:3]
        q, where = obs.num_new, f"layer {obs.layer_idx} ({obs.phase}): rule 'kvzap'"
        hidden = obs.attention_input
        if hidden is None or tuple(hidden.shape[:2]) != (B, q):
            got = "none" if hidden is None else f"a {list(hidden.shape)} tensor"
            raise RuntimeConfigError(f"{where} predicts each token's score from the hidden states entering the "
                                     f"attention module, [{B}, {q}, hidden size] for this forward, but it got {got}; "
                                     f"run the model inside polykv.apply, which captures them for kvzap layers")
        before = self.scores if self.scores is not None else torch.empty(B, Hkv, 0, device=obs.keys.device)
        if tuple(before.shape) != (B, Hkv, K - q):
            raise RuntimeConfigError(f"{where} holds the scores of {tuple(before.shape)} (batch, KV heads, tokens) "
                                     f"but this forward attends {K - q} earlier tokens: it must observe every forward "
                                     f"of the layer from the first; start a new cache")
        data = obs.model_data.get(KVZAP_KEY) if obs.model_data is not None else None
        new = surrogate_of(data, obs.layer_idx, obs.phase).predict(obs.layer_idx, hidden, surrogate=self.surrogate,
                                                                   kv_heads=Hkv)
        self.scores = torch.cat([before, new.to(before.device)], dim=-1)

    def read(self, ctx: SelectionContext) -> torch.Tensor:
        """The scores of ``ctx``'s stored tokens [B, Hkv, T] (read-only)."""
        if self.scores is None or self.scores.shape != ctx.positions.shape:
            have = None if self.scores is None else tuple(self.scores.shape)
            raise RuntimeConfigError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'kvzap' holds predicted scores of "
                                     f"{have} but the layer stores {tuple(ctx.positions.shape)} (batch, KV heads, "
                                     f"tokens): its state did not observe every forward of the layer")
        return self.scores

    def gather(self, selection) -> None:
        if self.scores is not None:
            self.scores = self.scores.gather(-1, selection.index)

    def nbytes(self) -> int:
        return 0 if self.scores is None else self.scores.numel() * 4

    def predict_bytes(self, *, batch: int, kv_heads: int, tokens: int, **shape) -> int:
        return batch * kv_heads * tokens * 4


def surrogate_of(data, layer_idx: int, phase: str) -> KVzapSurrogate:
    """The kvzap surrogate of ``model_data["kvzap"]`` (``data``), or a one-line error saying how to get one."""
    if data is None:
        raise ValueError(f"layer {layer_idx} ({phase}): rule 'kvzap' needs its surrogate in "
                         f"model_data['{KVZAP_KEY}']; train it with `polykv model-data MODEL kvzap -o FILE` and "
                         f"pass KVzapSurrogate.load(FILE), or let polykv.apply train one from the offline corpus")
    return data


class KVzapRule(ScoredRule):
    """Keep, per KV head, the tokens whose predicted (log) KVzip score is highest, or above ``threshold``.

    Score of stored token j in KV head h of layer l: ``s = f_l(x_j)[h]``, the surrogate ``surrogate`` of
    ``model_data["kvzap"]`` (:class:`~polykv.adapters.rules.kvzap_model.KVzapSurrogate`) on the hidden state
    ``x_j`` that entered the layer's attention with token j, predicted when the layer sees it (the rule's state).
    The first ``n_sink`` and the newest ``window`` tokens of every head are always kept.

    * ``threshold = None`` (fixed ratio, kvpress ``kvzap_mlp_head``): the top ``capacity`` per head.
    * ``threshold = tau`` (the paper's DMS-style mode): each head keeps its tokens with ``s > tau`` (and the
      protected ones), at most ``capacity``; counts differ per head and layer and the rest is freed (ragged
      storage). ``capacity`` is then a ceiling, and the rule runs only when a head holds more than it.

    Parameters
    ----------
    surrogate : {"mlp", "linear"}, default "mlp"
    threshold : float or None, default None
        Log-score threshold tau (the paper uses -4 on Qwen3-8B and sweeps -3 ... -9); None: fixed ratio.
    n_sink : int, default 4
        Leading tokens kept in every head (the surrogate never saw the sinks in training).
    window : int or None, default None
        Newest tokens kept in every head; None: 128 with a threshold (the paper's window), 0 without.
    """

    name = "kvzap"
    phases = frozenset(PHASES)
    signal = "none"
    shared_across_heads = False
    surrogate: str = param("mlp", choices=SURROGATES, description="regressor: mlp or linear")
    threshold: float | None = param(None, low=-1e6, high=1e6,
                                    description="keep predicted log-scores above it (null: fixed ratio)")
    n_sink: int = param(4, low=0, high=1 << 20, description="leading tokens kept in every head")
    window: int | None = param(None, low=0, high=1 << 20,
                               description="newest tokens kept in every head (null: 128 with a threshold, else 0)")
    model_data_need = SURROGATE_NEED
    paper = "Jégou & Jeblick, KVzap: learned query-agnostic KV cache compression (arXiv:2601.07891)"

    @property
    def recent(self) -> int:
        """The newest tokens kept in every head (``window``, resolved)."""
        if self.window is not None:
            return int(self.window)
        return 128 if self.threshold is not None else 0

    def check_capacity(self, capacity: int) -> None:
        """The protected tokens alone (``n_sink`` + the window) may not fill ``capacity``: the scores would decide
        nothing."""
        kept = int(self.n_sink) + self.recent
        if kept >= int(capacity):
            name = "window" if self.recent else "n_sink"
            window = "window (null: 128 with a threshold, 0 without)" if self.window is None else "window"
            raise ParamError(name, f"rule 'kvzap': n_sink + {window} = {kept} tokens are kept in every head but the "
                                   f"capacity is {int(capacity)} tokens per KV head, so the predicted scores would "
                                   f"decide nothing; lower n_sink or window (e.g. window=0) or raise the capacity")

    def new_state(self) -> PredictedScores:
        return PredictedScores(self.surrogate, (int(self.n_sink), self.recent))

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        return int(self.n_sink), self.recent

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """The predicted log KVzip scores of the stored tokens: [B, Hkv, T] float32 (from the rule's state)."""
        return scores_of(ctx)

    def select(self, ctx: SelectionContext, capacity: int):
        if self.threshold is None:
            return super().select(ctx, capacity)
        scores = self.score(ctx)
        B, Hkv, T = scores.shape
        keep = (scores > float(self.threshold)) | protected_mask(ctx, int(self.n_sink), self.recent)
        if ctx.valid is not None:
            keep &= ctx.valid
        budget = ctx.head_capacity if ctx.head_capacity is not None else torch.full((B, Hkv), int(capacity))
        counts = torch.minimum(keep.sum(-1), budget.to(keep.device).long().expand(B, Hkv)).clamp_min(1)
        return super().select(attrs.evolve(ctx, head_capacity=counts), capacity)


def scores_of(ctx: SelectionContext) -> torch.Tensor:
    """The predicted scores ``ctx``'s kvzap state holds for its stored tokens, or a one-line error without one."""
    got = ctx.state.component(PredictedScores) if ctx.state is not None else None
    if got is None:
        raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'kvzap' reads the scores its state predicted "
                         f"from the attention inputs it observed; this context carries no kvzap state (run the rule "
                         f"through polykv.apply)")
    return got.read(ctx)


def protected_mask(ctx: SelectionContext, n_first: int, n_last: int) -> torch.Tensor:
    """[B, Hkv, T] bool: the first ``n_first`` and last ``n_last`` tokens of every head (padding excluded)."""
    B, Hkv, T = ctx.positions.shape
    if ctx.valid is not None:
        rank = ctx.valid.long().cumsum(-1) - 1
        lengths = ctx.valid.sum(-1, keepdim=True)
    else:
        rank = torch.arange(T, device=ctx.positions.device).expand(B, Hkv, T)
        lengths = torch.full((B, Hkv, 1), T, device=ctx.positions.device)
    mask = (rank < n_first) | (rank >= lengths - n_last)
    return mask if ctx.valid is None else mask & ctx.valid


class KVzapAllocator(KVzipAllocator):
    """``kvzap (global)``: KVzip's global budget over KVzap's predicted scores: one ranking of every (layer, KV head,
    token) of the group, each head keeping its tokens among the group's top ``total x Hkv`` (ragged storage). A
    rule's protected tokens (sinks, window) rank first. Reads the member layers' ``kvzap`` rule state."""

    name = "kvzap"
    paper = KVzapRule.paper

    def bound(self, capacities, context_tokens: int) -> list[int]:
        """One head may take the whole prompt: its budget is a share of ``total x Hkv`` tokens, not of ``total``."""
        return [int(context_tokens) for _ in capacities]

    def layer_statistic(self, ctx) -> torch.Tensor:
        state = ctx.state.component(PredictedScores) if ctx.state is not None else None
        if state is None:   # check_op sees an op without its phase: such a plan is refused here, at the first layer
            raise RuntimeConfigError(f"layer {ctx.layer_idx}: allocator 'kvzap' ranks the predicted scores of rule "
                                     f"'kvzap', but this layer's prefill rule is not kvzap; set the prefill rule of "
                                     f"every layer of the allocation group to kvzap")
        if ctx.valid is not None:
            raise RuntimeConfigError(f"layer {ctx.layer_idx}: allocator 'kvzap' cannot read a ragged layer")
        scores = state.read(ctx).clone()
        scores[protected_mask(ctx, *state.protect)] = math.inf
        return scores[0]                                                          # (Hkv, T)
