"""Scissorhands: persistence of importance, counted over a history window of attention rows.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023 (arXiv:2305.17118), Algorithms 1 and 2. Reference code:
https://github.com/lzcemma/Scissorhands (``hf_opt_dropkv.py``: a prefill mask simulation for C4
perplexity that thresholds each row at its 90th percentile; the paper thresholds at 1/t).

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, r attention rows, T stored tokens.

A token j is *unimportant* for the query at position p when that query's softmax attention to it is
below a threshold: ``1 / (p + 1)``, the average mixing weight of a full row (``threshold =
"average"``, the paper's 1/t), or the row's ``quantile`` over the keys it sees (``threshold =
"quantile"``, the reference code). Only queries that can see j count (a token is never counted
unimportant for a query older than itself). The count of unimportant events over the last
``history`` rows, summed over the G query heads of each KV head, is the token's score: the
``recent`` newest tokens are always kept, and the tokens with the highest counts go first.
"""

from __future__ import annotations

import torch

from polykv.contract import PHASES, ParamError, RuleState, ScoredRule, SelectionContext, param, state


def unimportant_events(attn: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, *,
                       threshold: str = "average", quantile: float = 0.9) -> torch.Tensor:
    """Which (row, token) pairs are unimportant, summed over each KV head's G query heads.

    Parameters
    ----------
    attn : [B, H, r, T]
        Softmax attention rows of r queries over the T stored keys (0 where a key is not visible).
    query_positions : [r]
        Position of each row's query.
    key_positions : [B, Hkv, T]
        Original position of every stored key.

    Returns
    -------
    [B, Hkv, r, T] uint8: for each row and token, how many of the G query heads found it unimportant.
    """
    B, H, r, T = attn.shape
    Hkv = key_positions.shape[1]
    G = H // Hkv
    visible = key_positions.unsqueeze(2) <= query_positions.view(1, 1, r, 1).to(key_positions.device)  # (B,Hkv,r,T)
    vis_h = visible.repeat_interleave(G, dim=1)                                                     # (B, H, r, T)
    attn = attn.float()
    if threshold == "average":
        thr = 1.0 / (query_positions.to(attn.device).float() + 1.0)
        thr = thr.view(1, 1, r, 1)
    elif threshold == "quantile":
        masked = attn.masked_fill(~vis_h, float("nan"))
        thr = torch.nanquantile(masked, quantile, dim=-1, keepdim=True)                             # (B, H, r, 1)
    else:
        raise ValueError(f"rule 'scissorhands': threshold must be 'average' or 'quantile', got {threshold!r}")
    events = (attn < thr) & vis_h
    return events.view(B, Hkv, G, r, T).sum(dim=2).to(torch.uint8)


def history_attention(obs: state.Observation, rows: int) -> torch.Tensor:
    """Softmax attention of the last ``rows`` new queries of ``obs`` over its keys: [B, H, rows, K] float32.

    Each query sees the keys at positions up to its own (padding of a ragged layer never): the rows
    the attention pass computed (prefill), or computed now in chunks (read-only either way).
    """
    return obs.last_rows(rows)


class UnimportantHistory(RuleState):
    """Scissorhands' state: the unimportant events of the last ``history`` attention rows, per token.

    ``events`` [B, Hkv, r, T] uint8 (r <= history rows, oldest first; column j is storage column j)
    holds, per row and token, how many of the G query heads found the token unimportant. New tokens
    enter with 0 events in older rows (those queries could not see them); eviction gathers columns.
    """

    needs = frozenset({state.LAST_ROWS})

    def __init__(self, history: int, threshold: str, quantile: float):
        self.history, self.threshold, self.quantile = int(history), threshold, float(quantile)
        self.needed_rows = self.history
        self.share_key = ("scissorhands_history", self.history, self.threshold, self.quantile)
        self.reset()

    def reset(self) -> None:
        self.events: torch.Tensor | None = None

    def observe(self, obs: state.Observation) -> None:
        rows = min(self.history, obs.num_new)
        attn = history_attention(obs, rows)
        qpos = torch.arange(obs.first_position + obs.num_new - rows, obs.first_position + obs.num_new,
                            device=obs.keys.device)
        new = unimportant_events(attn, qpos, obs.positions, threshold=self.threshold, quantile=self.quantile)
        if self.events is not None:
            old = torch.nn.functional.pad(self.events, (0, new.shape[-1] - self.events.shape[-1]))
            new = torch.cat([old, new], dim=2)
        self.events = new[:, :, -self.history:].contiguous()

    def gather(self, selection) -> None:
        if self.events is not None:
            idx = selection.index.unsqueeze(2).expand(-1, -1, self.events.shape[2], -1)
            self.events = self.events.gather(-1, idx)

    def counts(self) -> torch.Tensor:
        """[B, Hkv, T] int32 unimportant events per stored token over the kept rows."""
        return self.events.sum(dim=2, dtype=torch.int32)

    def nbytes(self) -> int:
        return 0 if self.events is None else self.events.numel()

    def predict_bytes(self, *, batch, kv_heads, heads, head_dim, tokens, context_tokens, dtype_bytes) -> int:
        return batch * kv_heads * min(self.history, context_tokens) * tokens


class ScissorhandsRule(ScoredRule):
    """Drop the tokens that were unimportant most often over the last ``history`` attention rows.

    Score of token j = minus its unimportant count (:func:`unimportant_events`, summed over rows and
    the G query heads), read from the rule's own state (:class:`UnimportantHistory`), which records
    every forward's rows as they were computed; the ``recent`` newest stored tokens are always kept;
    ties keep the older token. In prefill the rows are the last ``history`` prompt queries. In decode
    the paper drops ``m = B / 2`` tokens whenever the cache reaches its budget B: a plan reproduces
    that with capacity B / 2 and a trigger slack of B / 2.

    Parameters
    ----------
    history : int, default 400
        History window w of attention rows (paper: 400 in every experiment).
    recent : int, default 10
        Newest tokens never dropped (paper r = 10).
    threshold : {"average", "quantile"}, default "average"
        ``"average"``: unimportant below 1 / (p + 1) (paper). ``"quantile"``: below the row's
        ``quantile`` (reference code: the 90th percentile).
    quantile : float, default 0.9
        Row quantile of the ``"quantile"`` threshold.
    """

    name = "scissorhands"
    phases = frozenset(PHASES)
    signal = "none"
    history: int = param(400, low=1, high=1 << 20, description="attention rows remembered")
    recent: int = param(10, low=0, high=1 << 20, description="recent tokens always kept")
    threshold: str = param("average", choices=("average", "quantile"), description="importance cut")
    quantile: float = param(0.9, low=0.0, high=1.0, description="quantile of the quantile cut")
    shared_across_heads = False
    paper = ("Liu et al., Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache "
             "Compression at Test Time, NeurIPS 2023 (arXiv:2305.17118)")

    def __attrs_post_init__(self):
        quantile = float(self.quantile)
        if not 0.0 < quantile < 1.0:                          # the spec's bounds are inclusive: exclude 0 and 1
            raise ParamError("quantile", f"rule 'scissorhands': parameter 'quantile' must lie in (0, 1), "
                                         f"got {quantile}")

    def new_state(self) -> UnimportantHistory:
        return UnimportantHistory(int(self.history), self.threshold, float(self.quantile))

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """Minus the unimportant counts: [B, Hkv, T] float32."""
        if not isinstance(ctx.state, UnimportantHistory) or ctx.state.events is None:
            raise ValueError(
                f"layer {ctx.layer_idx} ({ctx.phase}): rule 'scissorhands' reads its unimportant counts from "
                f"ctx.state (an UnimportantHistory from new_state()); the runtime must observe every forward")
        return -ctx.state.counts().float()

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        return 0, int(self.recent)
