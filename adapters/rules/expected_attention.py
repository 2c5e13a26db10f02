"""Expected Attention: score keys by the attention a Gaussian model of future queries is expected to pay them.

Devoto, Jeblick, Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution", arXiv:2510.00636 (2025). Reference code: NVIDIA/kvpress,
``kvpress/presses/expected_attention_press.py`` (and ``decoding_press.py`` for decode).
"""

from __future__ import annotations

import math

import torch

from polykv.contract import PHASES, RuleState, ScoredRule, SelectionContext, param, state


def undo_rope(query: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries (times the RoPE attention scaling) of post-RoPE ``query`` [B, H, q, d] at ``positions``
    [q]: ``q~ = q cos - rotate_half(q) sin`` ("half" pairing), float64, [B, H, q, d]. Exact: R_p is orthogonal."""
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(query.device, torch.float64)[None, :]  # (q, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)    # (q, d)
    q = query.double()
    F = q.shape[-1] // 2
    rot = torch.cat([-q[..., F:], q[..., :F]], dim=-1)                                          # rotate_half(q)
    return q * cos - rot * sin


class QueryMoments(RuleState):
    """Running moments of the prompt's pre-RoPE queries, per batch row and query head (prefill).

    Every prefill forward's post-RoPE queries at positions ``>= n_sink`` are un-rotated (:func:`undo_rope`) and
    added to ``count``, ``total`` [B, H, d] and ``outer`` [B, H, d, d] (float64): O(H d^2) memory whatever the
    prompt length or the number of prefill chunks. An :class:`Observation` that carries no RoPE frequencies
    (one built by hand) keeps its queries until the rule folds them with ``ctx.rope_inv_freq``.
    """

    metadata_name = "query_moments"

    def __init__(self, n_sink: int):
        self.n_sink = int(n_sink)
        self.share_key = ("query_moments", self.n_sink)  # (what the prompt's queries give: a prefill snapshot
        # hands it to every plan that folds the same positions)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None
        self.outer: torch.Tensor | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(post-RoPE queries [B, H, q, d], positions [q]) not folded yet (no frequencies known)."""

    def observe(self, obs: state.Observation) -> None:
        if obs.phase != "prefill":
            return  # decode scores from the query buffer
        pos = torch.arange(obs.first_position, obs.first_position + obs.num_new, device=obs.query.device)
        keep = pos >= self.n_sink
        if not bool(keep.any()):
            return
        query, pos = obs.query[:, :, keep], pos[keep]
        if obs.rope_inv_freq is None:
            self.pending.append((query, pos))
        else:
            self._fold(query, pos, obs.rope_inv_freq)

    def _fold(self, query, pos, inv_freq) -> None:
        q = undo_rope(query, pos, inv_freq)                                     # (B, H, q, d)
        total, outer = q.sum(2), torch.einsum("bhti,bhtj->bhij", q, q)
        self.total = total if self.total is None else self.total + total
        self.outer = outer if self.outer is None else self.outer + outer
        self.count += int(q.shape[2])

    def moments(self, inv_freq: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean [B, H, d] and covariance [B, H, d, d] (1/N) of the folded queries, float64 (zeros when none)."""
        for query, pos in self.pending:
            self._fold(query, pos, inv_freq)
        self.pending = []
        B, H, d = shape
        if not self.count:
            z = torch.zeros(B, H, d, dtype=torch.float64, device=inv_freq.device)
            return z, z.unsqueeze(-1) * z.unsqueeze(-2)
        mu = self.total / self.count
        return mu, self.outer / self.count - mu.unsqueeze(-1) * mu.unsqueeze(-2)

    def after_prefill(self) -> None:
        self.reset()

    def nbytes(self) -> int:
        held = sum(t.numel() * 8 for t in (self.total, self.outer) if t is not None)
        return held + sum(q.numel() * q.element_size() + p.numel() * 8 for q, p in self.pending)

    def predict_bytes(self, *, batch, kv_heads, heads, head_dim, tokens, context_tokens, dtype_bytes) -> int:
        return 0  # emptied after prefill


class QueryBuffer(state.QueryWindow):
    """The last ``window`` post-RoPE queries the layer processed (decode's query buffer); no attention rows."""

    needs = frozenset()

    def __init__(self, window: int):
        super().__init__(window)
        self.needed_rows = 0
        self.share_key = ("query_buffer", self.window)


def buffer_moments(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   n_sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [B, H, d] and covariance [B, H, d, d] (1/N) of the pre-RoPE ``queries`` [B, H, w, d] at
    ``positions`` [w] >= ``n_sink``, float64 (zeros when none)."""
    keep = positions >= n_sink
    q = undo_rope(queries[:, :, keep], positions[keep], inv_freq)              # (B, H, n, d)
    if q.shape[2] == 0:
        z = torch.zeros(*q.shape[:2], q.shape[-1], dtype=torch.float64, device=q.device)
        return z, z.unsqueeze(-1) * z.unsqueeze(-2)
    mu = q.mean(2)
    c = q - mu.unsqueeze(2)
    return mu, torch.einsum("bhti,bhtj->bhij", c, c) / q.shape[2]


def mean_future_rotation(inv_freq: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """R̄ = mean over p in [start, start + count) of R_p = cos_p I + sin_p P (P the rotate_half matrix):
    [d, d] float64."""
    dev = inv_freq.device
    p = torch.arange(start, start + count, dtype=torch.float64, device=dev)
    ang = torch.remainder(p[:, None] * inv_freq.to(dev, torch.float64)[None, :], 2 * math.pi)  # (n_f, d/2)
    c, s = ang.cos().mean(0), ang.sin().mean(0)                                 # (d/2,)
    F = c.numel()
    R = torch.zeros(2 * F, 2 * F, dtype=torch.float64, device=dev)
    i = torch.arange(F, device=dev)
    R[i, i], R[i + F, i + F] = c, c
    R[i, i + F], R[i + F, i] = -s, s                                           # (R x)[:F] = c x[:F] - s x[F:]
    return R


class ExpectedAttentionRule(ScoredRule):
    """Keep, per KV head, the tokens a Gaussian model of the next queries is expected to attend to most.

    Query model (per batch row and query head h): ``mu``, ``Sigma`` = mean and covariance (1/N) of the
    pre-RoPE queries of the prompt at positions >= ``n_sink`` (prefill), or of the last ``query_buffer``
    queries the layer processed (decode). The average rotation over the next ``n_future_positions``
    positions ``R̄ = mean_{p in [t, t + n_f)} R_p`` starts at ``t = ctx.tokens_seen``, the real position of
    the next token; ``mu' = R̄ mu``, ``Sigma' = R̄ Sigma R̄^T``. For a stored post-RoPE key ``k_j`` (storage
    column j, not one of the first ``n_sink`` stored columns)::

        z_hj = mu'_h . k_j / sqrt(d) + k_j^T Sigma'_h k_j / (2 d)     (log E[exp(q.k/sqrt d)], q ~ N(mu', Sigma'))
        a_hj = softmax_j(z_hj)
        s_j  = mean over the G query heads of the KV head of a_hj,   then (s_j + epsilon) * ||v_j||_2

    The first ``n_sink`` stored columns are always kept (scored max + 1, as kvpress pads them with its max).

    Shapes: keys, values [B, Hkv, T, d]; mu' [B, H, d]; Sigma' [B, H, d, d]; scores [B, Hkv, T].

    Where this differs from the reference (kvpress ExpectedAttentionPress / DecodingPress):

    - the pre-RoPE queries are the layer's own queries with RoPE undone (exact, RoPE being a rotation per
      position), not ``hidden_states @ W_q^T`` recomputed: a q_proj bias (Qwen2) is included in ``mu``, and
      models with a query norm (Qwen3, Gemma 3), which kvpress refuses, are scored from their real queries;
    - kvpress averages R_p over ``[q_len, q_len + n_f)`` with ``q_len`` the number of hidden states it was
      given: right for a one-forward prefill from position 0, but in chunked prefill and in decode (its
      buffer holds at most 256 recent hidden states) the rotation sits at the wrong offset. Here it always
      starts at the next token's absolute position;
    - chunked prefill: the moments cover every chunk of the prompt (kvpress sees one chunk), and the
      queries dropped as sinks are those at absolute positions < ``n_sink`` (kvpress drops the first
      ``n_sink`` hidden states it is given, in decode those of its buffer);
    - decode: the buffer keeps the last ``query_buffer`` queries whatever evicted (kvpress clears it at
      every compression and starts from decode tokens only); the cadence is the runtime's trigger slack
      (kvpress compresses every 512 steps).

    Parameters
    ----------
    n_future_positions : int, default 512
        Future positions the rotation is averaged over.
    n_sink : int, default 4
        First stored tokens always kept and left out of the softmax; queries at positions below it are
        left out of the statistics.
    use_covariance : bool, default True
        Add the covariance term ``k^T Sigma' k / (2d)``.
    use_vnorm : bool, default True
        Multiply by the value norm.
    epsilon : float, default 0.0
        Added to the probabilities before the value-norm rescaling.
    query_buffer : int, default 256
        Decode: how many recent queries the statistics come from (kvpress ``hidden_states_buffer_size``).
    """

    name = "expected-attention"
    phases = frozenset(PHASES)
    needs_values = True
    reads_rope = True
    n_future_positions: int = param(512, low=1, high=1 << 24,
                                    description="future positions the RoPE rotation is averaged over")
    n_sink: int = param(4, low=0, high=1 << 20, description="first tokens always kept")
    use_covariance: bool = param(True, description="add the query covariance term")
    use_vnorm: bool = param(True, description="rescale by the value norm")
    epsilon: float = param(0.0, low=0.0, high=1e6, description="added before the value-norm rescaling")
    query_buffer: int = param(256, low=1, high=1 << 20, description="decode: recent queries the statistics come from")
    paper = ("Devoto, Jeblick, Jégou, Expected Attention: KV Cache Compression by Estimating Attention from "
             "Future Queries Distribution, arXiv:2510.00636 (2025)")

    def new_state(self) -> RuleState:
        # Prompt moments for prefill, the recent-query buffer for decode (the moments are dropped after prefill).
        return state.CompositeState(QueryMoments(int(self.n_sink)), QueryBuffer(int(self.query_buffer)))

    def protected(self, ctx: SelectionContext, capacity: int) -> tuple[int, int]:
        return int(self.n_sink), 0

    def _inv_freq(self, ctx: SelectionContext) -> torch.Tensor:
        if ctx.rope_inv_freq is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'expected-attention' needs the model's RoPE "
                             f"frequencies (ctx.rope_inv_freq) to undo and average RoPE; it runs only on RoPE models")
        d = ctx.keys.shape[-1]
        if ctx.rope_inv_freq.numel() * 2 != d:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'expected-attention' got "
                             f"{ctx.rope_inv_freq.numel()} RoPE frequencies for head dim {d}; it needs d/2 "
                             f"(partial rotary embeddings are not supported)")
        return ctx.rope_inv_freq.to(ctx.keys.device)

    def query_statistics(self, ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE mean [B, H, d] and covariance [B, H, d, d] (float64) of the phase's queries."""
        inv = self._inv_freq(ctx)
        state = ctx.state
        moments = None if state is None else state.component(QueryMoments)
        n_sink = int(self.n_sink)
        if ctx.phase == "prefill" and moments is not None:
            if ctx.queries is None:
                raise ValueError(f"layer {ctx.layer_idx} (prefill): rule 'expected-attention' has no queries")
            B, H, _, d = ctx.queries.shape
            return moments.moments(inv, (B, H, d))
        if ctx.queries is None or ctx.query_positions is None:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'expected-attention' got no queries; "
                             f"build its state with rule.new_state() and let it observe the layer's forwards")
        return buffer_moments(ctx.queries, ctx.query_positions.to(ctx.keys.device), inv, n_sink)

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """(mean over the group of softmax_j z_hj + epsilon) * ||v_j||: [B, Hkv, T] float32."""
        n_sink = int(self.n_sink)
        B, Hkv, T, d = ctx.keys.shape
        mu, cov = self.query_statistics(ctx)                                # (B, H, d), (B, H, d, d)
        H = mu.shape[1]
        G = H // Hkv
        R = mean_future_rotation(self._inv_freq(ctx), ctx.tokens_seen, int(self.n_future_positions)).to(mu.device)
        mu = (mu @ R.T).float().view(B, Hkv, G, d)                         # mu' = R̄ mu
        k = ctx.keys.float()                                                # (B, Hkv, T, d)
        z = torch.einsum("bkgd,bktd->bkgt", mu, k) / math.sqrt(d)          # (B, Hkv, G, T)
        if self.use_covariance:
            cov = (R @ cov @ R.T).float().view(B, Hkv, G, d, d)             # Sigma' = R̄ Sigma R̄^T
            z = z + torch.einsum("bkti,bkgij,bktj->bkgt", k, cov, k) / (2 * d)
        if ctx.valid is None:
            rank = torch.arange(T, device=k.device).expand(B, Hkv, T)
            candidate = rank >= n_sink
        else:
            rank = ctx.valid.long().cumsum(-1) - 1                          # rank of a token within its head
            candidate = ctx.valid & (rank >= n_sink)
        z = z.masked_fill(~candidate.unsqueeze(2), -math.inf)
        a = torch.softmax(z, dim=-1).nan_to_num(0.0).mean(dim=2)          # (B, Hkv, T)
        if self.use_vnorm:
            a = (a + float(self.epsilon)) * ctx.values.float().norm(dim=-1)
        a = a.masked_fill(~candidate, 0.0)
        sink = (rank < n_sink) if ctx.valid is None else (ctx.valid & (rank < n_sink))
        top = a.amax(dim=-1, keepdim=True) + 1.0                            # sinks: max + 1 of their head
        return torch.where(sink, top.expand_as(a), a)
