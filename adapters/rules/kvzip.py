"""KVzip: query-agnostic eviction scored by how much a context-reconstruction pass attends each token.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv:2505.23416.
Reference code: https://github.com/snu-mllab/KVzip (attention/score.py ``_get_score``, model/wrapper.py);
kvpress ``KVzipPress`` (https://github.com/NVIDIA/kvpress, kvzip_press.py ``prepare``, ``score_kvzip``).

After the prompt (a ``prefix_tokens`` prefix, e.g. chat template + system prompt, then the context c),
the rule runs a probe (:mod:`polykv.contract.probe`): c is cut into chunks of ``chunk_size`` tokens and
chunk i runs as ``P_i + suffix + c_i`` against the uncompressed prompt cache, where
``P_0 = "\\n\\nRepeat the previous context exactly."`` and, for i > 0,
``P_i = "\\n\\nRepeat the part of the previous context exactly, starting with"`` + the last
``carry_tokens`` ids of c_{i-1}; ``suffix`` is the assistant header of the chat template. The probe's
keys and values are discarded; the rule keeps the top ``capacity`` tokens per KV head of the scores
(the per-layer budget, the reference's ``pair-uniform`` level).

The runtime is tokenizer-free, so the three fixed strings arrive as token ids in the parameters
``repeat_ids``, ``continue_ids`` and ``suffix_ids``; :func:`prompt_params` builds them from a tokenizer.
"""

from __future__ import annotations

import torch

from polykv.contract import (HEAD_SCORES_SUFFIX, SIGNAL_NONE, AllocationRequest, Allocator, HeadScores, ModelDataNeed,
                             ParamError, ParamSpec, ProbeChunk, RuleState, ScoredRule, SelectionContext,
                             ragged_top_k, run_probe, tokenizer_of)

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
"""P_0, the reconstruction prompt of the first chunk (reference and kvpress)."""
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
"""The prompt of every later chunk, followed by the last ``carry_tokens`` ids of the previous chunk (kvpress's
string; the reference code ends it with a space)."""
SINKS = ("tokens", "prefix")


def prompt_params(tokenizer) -> dict:
    """``{"repeat_ids", "continue_ids", "suffix_ids"}`` for ``tokenizer``: the two prompts' ids and the chat
    template's assistant header after a user turn (kvpress's construction; ``"\\n"`` without a template)."""
    def ids(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]

    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        suffix = text.split(separator)[1]
    return {"repeat_ids": ids(REPEAT_PROMPT), "continue_ids": ids(CONTINUE_PROMPT), "suffix_ids": ids(suffix)}


SCORE_CHUNK_ELEMENTS = 1 << 21
"""Logits per query-row chunk of :func:`reconstruction_scores` (8 MiB of float32)."""


def reconstruction_scores(query: torch.Tensor, keys: torch.Tensor, span: tuple[int, int], sink: int,
                          scaling: float) -> torch.Tensor:
    """KVzip's score of the context chunk ``span`` from one probe forward: [B, Hkv, end - start] float32.

    Parameters
    ----------
    query : [B, H, n, d] post-RoPE queries of the probe chunk's n tokens.
    keys : [B, Hkv, T + n, d] post-RoPE keys: the T prompt tokens, then the chunk's own n.
    span : (start, end) prompt tokens of the context chunk scored.
    sink : the first ``sink`` prompt keys join every softmax (attention sinks, or the whole prefix).

    Each query attends only [sink | keys[start:end] | its own chunk's keys up to itself] (softmax over that
    subset, float32); the score of token j is the largest probability any of the n queries and the G query
    heads of its KV head gives it. Query rows run in chunks of at most :data:`SCORE_CHUNK_ELEMENTS` logits;
    the causal mask covers only the chunk's own keys (no mask over the prompt's keys is built).
    """
    B, H, n, d = query.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    start, end = span
    T, C = keys.shape[2] - n, end - start
    S = sink
    subset = torch.cat([keys[:, :, :S], keys[:, :, start:end], keys[:, :, T:]], dim=2).float()  # (B, Hkv, S + C + n, d)
    subset = subset.transpose(-1, -2)                                                            # (B, Hkv, d, S + C + n)
    q = (query.float() * scaling).view(B, Hkv, G, n, d)                                          # (B, Hkv, G, n, d)
    rows = max(1, SCORE_CHUNK_ELEMENTS // (B * H * (S + C + n)))
    best = None
    for a in range(0, n, rows):
        b = min(a + rows, n)
        r, width = b - a, S + C + b                          # rows a..b see their own chunk's keys up to b at most
        logits = (q[:, :, :, a:b].reshape(B, Hkv, G * r, d) @ subset[..., :width]).view(B, Hkv, G, r, width)
        later = torch.arange(b, device=query.device).view(1, b) > torch.arange(a, b, device=query.device).view(-1, 1)
        logits[..., S + C:].masked_fill_(later, float("-inf"))                                  # causal on own keys
        got = torch.softmax(logits, dim=-1)[..., S:S + C].amax(dim=(2, 3))                      # (B, Hkv, C)
        best = got if best is None else torch.maximum(best, got)
    return best


class ReconstructionScores(RuleState):
    """The scores of every prompt token, filled chunk by chunk from the probe's forwards ([B, Hkv, T] float32)."""

    observes_probe = True
    metadata_name = "rule_state"

    def __init__(self, *, sink: str, n_sink: int, prefix_tokens: int):
        self.sink, self.n_sink, self.prefix_tokens = sink, int(n_sink), int(prefix_tokens)
        self.share_key = ("kvzip-reconstruction", sink, self.n_sink, self.prefix_tokens)  # (a prefill snapshot
        # keeps one per probe: polykv.runtime.fork keys its prefills by the probe's ids)
        self.reset()

    def reset(self) -> None:
        self.scores: torch.Tensor | None = None

    def observe(self, obs) -> None:
        if obs.probe is None:  # the prompt's own forwards: nothing to record
            return
        T = obs.first_position
        B, Hkv = obs.keys.shape[0], obs.keys.shape[1]
        if self.scores is None or self.scores.shape != (B, Hkv, T):
            self.scores = torch.zeros(B, Hkv, T, dtype=torch.float32, device=obs.keys.device)
            if self.sink == "tokens":  # kvpress: the first n_sink tokens score 1.0, other prefix tokens 0
                self.scores[..., :self.n_sink] = 1.0
            else:  # the reference: the whole prefix is the sink, never evicted
                self.scores[..., :self.prefix_tokens] = float("inf")
        start, end = obs.probe.span
        sink = min(self.n_sink, start) if self.sink == "tokens" else min(self.prefix_tokens, start)
        self.scores[..., start:end] = reconstruction_scores(obs.query, obs.keys, (start, end), sink, obs.scaling)

    def gather(self, selection) -> None:
        if self.scores is not None:
            self.scores = self.scores.gather(-1, selection.index)

    def nbytes(self) -> int:
        return 0 if self.scores is None else self.scores.numel() * 4

    def predict_bytes(self, **shape) -> int:
        return 0  # dropped with the prefill rule's state once the prompt is stored


def _ids(name: str, value) -> None:
    if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ParamError(name, f"parameter '{name}' must be a list of token ids (integers >= 0), got {value!r}")


class KVzipRule(ScoredRule):
    """Keep, per KV head, the ``capacity`` prompt tokens a context-reconstruction probe attends most.

    Parameters
    ----------
    chunk_size : int, default 2048
        Context tokens per reconstruction chunk (kvpress 2048; the reference code uses 2000).
    carry_tokens : int, default 8
        Ids of the previous chunk's end repeated after the continuation prompt (reference ``prev_postfix_size``).
    sink : {"tokens", "prefix"}, default "tokens"
        ``"tokens"`` (kvpress, the default): the first ``n_sink`` tokens join every softmax and score 1.0,
        other prefix tokens score 0. ``"prefix"`` (the reference code): the whole ``prefix_tokens`` prefix
        joins every softmax and is always kept.
    n_sink : int, default 4
        Attention-sink tokens with ``sink="tokens"``.
    prefix_tokens : int, default 0
        Prompt tokens before the context (chat template, system prompt): not reconstructed.
    repeat_ids, continue_ids, suffix_ids : list of int
        Token ids of :data:`REPEAT_PROMPT`, :data:`CONTINUE_PROMPT` and the assistant header for the model's
        tokenizer (:func:`prompt_params`); required when the rule runs.
    """

    name = "kvzip"
    phases = frozenset({"prefill"})
    signal = SIGNAL_NONE
    shared_across_heads = False
    param_specs = {
        "chunk_size": ParamSpec(int, default=2048, low=1, high=1 << 20, description="context tokens per chunk"),
        "carry_tokens": ParamSpec(int, default=8, low=0, high=1 << 12,
                                  description="previous chunk's last ids repeated in the next prompt"),
        "sink": ParamSpec(str, default="tokens", choices=SINKS, description="attention sinks: n_sink tokens or the prefix"),
        "n_sink": ParamSpec(int, default=4, low=0, high=1 << 20, description="attention-sink tokens"),
        "prefix_tokens": ParamSpec(int, default=0, low=0, high=1 << 30, description="prompt tokens before the context"),
        "repeat_ids": ParamSpec(list, default=None, nullable=True, description="token ids of the first chunk's prompt"),
        "continue_ids": ParamSpec(list, default=None, nullable=True, description="token ids of later chunks' prompt"),
        "suffix_ids": ParamSpec(list, default=None, nullable=True, description="token ids of the assistant header"),
    }
    paper = ("Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
             "(arXiv:2505.23416)")

    def __init__(self, **params):
        super().__init__(**params)
        for name in ("repeat_ids", "continue_ids", "suffix_ids"):
            _ids(name, self.params[name])

    def new_state(self) -> ReconstructionScores:
        p = self.params
        return ReconstructionScores(sink=p["sink"], n_sink=p["n_sink"], prefix_tokens=p["prefix_tokens"])

    def probe_chunks(self, prompt_ids: torch.Tensor) -> list[ProbeChunk]:
        """``P_i + suffix + c_i`` for each context chunk c_i of ``prompt_ids`` [B, T] after the prefix."""
        p = self.params
        missing = [k for k in ("repeat_ids", "continue_ids", "suffix_ids") if p[k] is None]
        if missing:
            raise ValueError(f"parameters {missing} are not set: they hold the token ids of the reconstruction "
                             f"prompts for this model's tokenizer; set them from "
                             f"polykv.adapters.rules.kvzip.prompt_params(tokenizer)")
        B, T = prompt_ids.shape
        prefix, size, carry = int(p["prefix_tokens"]), int(p["chunk_size"]), int(p["carry_tokens"])
        if prefix >= T:
            raise ValueError(f"parameter 'prefix_tokens' is {prefix} but the prompt has {T} tokens: no context is left "
                             f"to reconstruct")

        def row(ids):
            return torch.tensor(ids, dtype=torch.long, device=prompt_ids.device).view(1, -1).expand(B, -1)

        repeat, cont, suffix = row(p["repeat_ids"]), row(p["continue_ids"]), row(p["suffix_ids"])
        prompt_ids = prompt_ids.long()
        out, prev = [], None
        for i, start in enumerate(range(prefix, T, size)):
            end = min(start + size, T)
            chunk = prompt_ids[:, start:end]
            head = repeat if prev is None else torch.cat([cont, prev[:, prev.shape[1] - min(carry, prev.shape[1]):]], 1)
            out.append(ProbeChunk(ids=torch.cat([head, suffix, chunk], dim=1), span=(start, end), index=i))
            prev = chunk
        return out

    def score(self, ctx: SelectionContext) -> torch.Tensor:
        """The reconstruction scores of the stored prompt tokens: [B, Hkv, T] float32."""
        state = ctx.state.component(ReconstructionScores) if ctx.state is not None else None
        if state is None or state.scores is None or state.scores.shape != ctx.positions.shape:
            raise ValueError(f"layer {ctx.layer_idx} ({ctx.phase}): rule 'kvzip' has no reconstruction scores for "
                             f"the {ctx.num_stored} stored tokens: its probe runs only after a prompt forward inside "
                             f"polykv.apply")
        return state.scores


class KVzipAllocator(Allocator):
    """KVzip's global budget (the reference's ``pair`` level): one ranking of the reconstruction scores over
    every (layer, KV head, token) of the group; each head keeps its tokens among the group's top
    ``total x Hkv``, so heads and layers keep different counts (ragged storage: the memory is freed).

    The group's total is the sum of its layers' planned capacities (tokens per KV head). Two departures from
    the reference, both to keep the budget exact: it keeps exactly the top ``total x Hkv`` scores (the
    reference keeps those strictly above the ``int(N r) - 1``-th largest, one fewer), and every head keeps at
    least its best token (the runtime's budgets are at least 1). Reads the member layers' ``kvzip`` rule state.
    """

    name = "kvzip"
    defaults = {}
    paper = KVzipRule.paper
    one_row = True
    """Budgets from the prompt's scores: batches of one row only."""
    reads_rule_state = True

    def layer_statistic(self, ctx) -> torch.Tensor:
        state = ctx.state.component(ReconstructionScores) if ctx.state is not None else None
        if state is None or state.scores is None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'kvzip' ranks the reconstruction scores of rule "
                             f"'kvzip', but this layer's prefill rule is not kvzip (route the group's layers to it)")
        if ctx.valid is not None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'kvzip' cannot read a ragged layer")
        return state.scores[0]                                                   # (Hkv, T)

    def allocate(self, request: AllocationRequest) -> torch.Tensor:
        scores = torch.stack([s.float() for s in request.statistics])            # (n, Hkv, T)
        n, Hkv, T = scores.shape
        keep = min(int(request.total) * Hkv, n * Hkv * T)
        counts = torch.ones(n, Hkv, dtype=torch.long)                           # every head keeps its best token
        rest = scores.clone()
        best = rest.argmax(dim=-1, keepdim=True)
        rest.scatter_(-1, best, float("-inf"))
        extra = max(keep - n * Hkv, 0)
        if extra:
            top = rest.flatten().topk(extra).indices
            counts += torch.bincount(torch.div(top, T, rounding_mode="floor"), minlength=n * Hkv).view(n, Hkv)
        return counts


# -- the context-independent head level (the reference's ``--level head``) -------------------------------

HEAD_SCORES_KEY = "kvzip-head"
CALIBRATION_SINK = 4
"""Leading tokens of the calibration context that act as attention sinks (kvpress's ``n_sink``): they join
every softmax and take no part in the head scores' maximum."""


def compute_head_scores(model, token_batches, tokenizer=None, *, chunk_size: int = 2048) -> HeadScores:
    """KVzip's head scores s[l, h] = max_j S[l, h, j] from ONE calibration context, through the runtime's probe.

    ``token_batches`` (LongTensor [1, T] each, plain text) are joined into one context; the first
    :data:`CALIBRATION_SINK` tokens are its sinks. The reconstruction probe of rule ``kvzip`` runs over the
    rest (its prompts built from ``tokenizer``: :func:`prompt_params`; else the tokenizer saved beside the
    model) and the maximum reconstruction probability of each layer and KV head over the context is kept.
    """
    tokenizer = tokenizer if tokenizer is not None else tokenizer_of(model)
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
    check=lambda data, model: data.check_model(model), description="kvzip head scores", takes_tokenizer=True)
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
    signal = SIGNAL_NONE
    shared_across_heads = False
    model_data_need = HEAD_SCORES
    param_specs = {
        "sink": ParamSpec(str, default="tokens", choices=SINKS, description="kept in every head: n_sink tokens or the prefix"),
        "n_sink": ParamSpec(int, default=4, low=0, high=1 << 20, description="attention-sink tokens"),
        "prefix_tokens": ParamSpec(int, default=0, low=0, high=1 << 30, description="prompt tokens before the context"),
    }
    paper = KVzipRule.paper

    def new_state(self) -> HeadSinks:
        p = self.params
        return HeadSinks(sink=p["sink"], n_sink=p["n_sink"], prefix_tokens=p["prefix_tokens"])

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

    def allocate(self, request: AllocationRequest) -> torch.Tensor:
        scores = torch.stack([s for s, _ in request.statistics])                 # (n, Hkv)
        floors = torch.tensor([max(k, 1) for _, k in request.statistics]).view(-1, 1).expand_as(scores)
        counts = whole_heads(scores.flatten(), floors.flatten(), int(request.context_tokens),
                             int(request.total) * scores.shape[1])
        return counts.view_as(scores)
