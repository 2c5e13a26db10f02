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
``repeat_ids``, ``continue_ids`` and ``suffix_ids``: :func:`prompt_params`, which ``polykv.apply`` runs for a plan
that leaves them unset (the rule's ``tokenizer_params``).
"""

from __future__ import annotations

import math

import torch

from polykv.contract import Allocator, ParamError, RuleState, ScoredRule, SelectionContext, allocators, param, probe

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


PROBE_ATTENTION_ELEMENTS = 1 << 21
"""Logits per query-row block of :func:`attend_and_score` and per intra-op thread, up to
:data:`MAX_BLOCK_THREADS` threads (8 MiB of float32 each; the softmax overwrites them)."""
MAX_BLOCK_THREADS = 4
"""Blocks of :func:`attend_and_score` grow with the CPU's intra-op threads up to this many (32 MiB of logits)."""
SUBSET_MASS_FLOOR = 1e-12
"""Below this share of a row's attention on the score's subset, the block's score is taken from the subset's own
softmax of its logits (:func:`attend_and_score`)."""
MAX_ROW_GROUPS = 8
"""At most this many row groups per KV head in :func:`attend_and_score` (:func:`row_groups`)."""


def row_groups(items: int, device) -> int:
    """Row groups per KV head for a CPU batch of ``items`` (batch x KV heads) matrix products: enough that the
    products spread evenly over the intra-op threads (MKL gives each thread whole products: 3 KV heads on 2 threads
    leave one thread idle a third of the time), 1 on one thread or off the CPU."""
    if torch.device(device).type != "cpu":
        return 1
    threads = torch.get_num_threads()
    return min(threads // math.gcd(items, threads), MAX_ROW_GROUPS)


@torch.no_grad()
def attend_and_score(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, span: tuple[int, int], sink: int,
                     scaling: float, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe forward's attention and its KVzip score in one pass: (output [B, H, n, dv] in the query's dtype,
    the scores of :func:`reconstruction_scores` [B, Hkv, end - start] float32).

    ``query``, ``keys``, ``span``, ``sink`` as in :func:`reconstruction_scores`; ``values`` [B, Hkv, T + n, dv].
    Each block of query rows forms its float32 logits over the keys it sees (the prompt, then its own chunk's up to
    itself) once, and their softmax (in place), which meets the values (the attention output, as SDPA's). The
    score's softmax over the subset [sink | keys[start:end] | own keys] is the same probabilities divided by the
    subset's share of the row: ``p_j / sum_{k in subset} p_k`` (equal to it to float32 rounding). A block where
    some row puts less than :data:`SUBSET_MASS_FLOOR` on the subset (its probabilities there could underflow)
    takes the subset's softmax of its logits (formed again) instead, as :func:`reconstruction_scores` does.

    ``groups``: the block's G x r query rows of each KV head run as this many products of equal size, each against
    its own copy of the keys and values (None: :func:`row_groups`); a block whose rows do not divide runs as one.
    Nothing is recorded for autograd (the probe's forwards run without it: :mod:`polykv.runtime.probe_pass`).
    """
    B, H, n, d = query.shape
    Hkv, W, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    G, T = H // Hkv, W - n
    start, end = span
    work, device = torch.float32, query.device
    P = max(1, int(groups)) if groups is not None else row_groups(B * Hkv, device)
    # (B * Hkv * P, d, T + n): each KV head's keys P times over, row-major, the products' fast side
    keys_t = keys.to(work).transpose(-1, -2).unsqueeze(2).expand(B, Hkv, P, d, W).reshape(B * Hkv * P, d, W)
    vals = values.to(work).unsqueeze(2).expand(B, Hkv, P, W, dv).reshape(B * Hkv * P, W, dv)
    q = (query.to(work) * scaling).view(B, Hkv, G, n, d)
    out = torch.empty(B, Hkv, G, n, dv, dtype=query.dtype, device=device)
    share = min(torch.get_num_threads(), MAX_BLOCK_THREADS) if device.type == "cpu" else 1
    rows = min(max(P, PROBE_ATTENTION_ELEMENTS * share // (B * H * W) // P * P), n)   # (a multiple of P: groups divide)
    block = torch.empty(B * H * rows * W, dtype=work, device=device)  # every block's logits, then probabilities
    later = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
    best = torch.zeros(B, Hkv, end - start, dtype=work, device=device)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        r, width = b - a, T + b                  # rows a..b see the prompt and their own chunk's keys up to b
        p = P if (G * r) % P == 0 else 1
        qs = q[:, :, :, a:b].reshape(B * Hkv * p, G * r // p, d)
        ks, vs = keys_t[::P // p, :, :width], vals[::P // p, :width]
        probs = torch.bmm(qs, ks, out=block[:B * H * r * width].view(B * Hkv * p, G * r // p, width))
        p5 = probs.view(B, Hkv, G, r, width)
        p5[..., T + a:].masked_fill_(later[:r, :r], float("-inf"))   # own keys a..b: causal (those before a: seen)
        torch.softmax(probs, dim=-1, out=probs)
        out[:, :, :, a:b] = torch.bmm(probs, vs).view(B, Hkv, G, r, dv)
        mass = p5[..., start:end].sum(-1, keepdim=True) + p5[..., T:].sum(-1, keepdim=True)
        if sink:
            mass += p5[..., :sink].sum(-1, keepdim=True)
        if bool((mass < SUBSET_MASS_FLOOR).any()):
            logits = torch.bmm(qs, ks).view(B, Hkv, G, r, width)
            logits[..., T + a:].masked_fill_(later[:r, :r], float("-inf"))
            subset = torch.cat([logits[..., :sink], logits[..., start:end], logits[..., T:]], dim=-1)
            got = torch.softmax(subset, dim=-1)[..., sink:sink + end - start].amax(dim=(2, 3))
        else:
            got = p5[..., start:end].div_(mass).amax(dim=(2, 3))                              # (B, Hkv, C)
        torch.maximum(best, got, out=best)
    return out.view(B, H, n, dv), best


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
        self.attended = None  # the probe chunk whose scores attend_probe recorded in its attention pass

    def _sink(self, start: int) -> int:
        return min(self.n_sink, start) if self.sink == "tokens" else min(self.prefix_tokens, start)

    def _scores_for(self, B: int, Hkv: int, T: int, device) -> torch.Tensor:
        """The [B, Hkv, T] scores being filled (fresh, with the sinks' scores, when the prompt changed)."""
        if self.scores is None or self.scores.shape != (B, Hkv, T):
            self.scores = torch.zeros(B, Hkv, T, dtype=torch.float32, device=device)
            if self.sink == "tokens":  # kvpress: the first n_sink tokens score 1.0, other prefix tokens 0
                self.scores[..., :self.n_sink] = 1.0
            else:  # the reference: the whole prefix is the sink, never evicted
                self.scores[..., :self.prefix_tokens] = float("inf")
        return self.scores

    def attend_probe(self, query, keys, values, scaling: float, probe, first_position: int) -> torch.Tensor:
        """The probe forward's attention output, its scores recorded from the same logits
        (:func:`attend_and_score`; :mod:`polykv.contract.probe`)."""
        start, end = probe.span
        out, got = attend_and_score(query, keys, values, (start, end), self._sink(start), scaling)
        self._scores_for(keys.shape[0], keys.shape[1], first_position, keys.device)[..., start:end] = got
        self.attended = probe
        return out

    def observe(self, obs) -> None:
        if obs.probe is None:  # the prompt's own forwards: nothing to record
            return
        if self.attended is obs.probe:  # attend_probe already scored this forward
            self.attended = None
            return
        start, end = obs.probe.span
        scores = self._scores_for(obs.keys.shape[0], obs.keys.shape[1], obs.first_position, obs.keys.device)
        scores[..., start:end] = reconstruction_scores(obs.query, obs.keys, (start, end), self._sink(start),
                                                       obs.scaling)

    def gather(self, selection) -> None:
        if self.scores is not None:
            self.scores = self.scores.gather(-1, selection.index)

    def nbytes(self) -> int:
        return 0 if self.scores is None else self.scores.numel() * 4

    def predict_bytes(self, **shape) -> int:
        return 0  # dropped with the prefill rule's state once the prompt is stored


PROMPT_PARAMS = ("repeat_ids", "continue_ids", "suffix_ids")
MAX_TOKEN_ID = (1 << 31) - 1


def _ids_param(what: str, min_items: int = 1):
    """A ``list[int] | None`` parameter of prompt token ids (null until the model's tokenizer builds them)."""
    return param(None, low=0, high=MAX_TOKEN_ID, min_items=min_items, token_ids=True,
                 description=f"token ids of {what}; null: built from the model's tokenizer")


def check_sink_capacity(name: str, params: dict, capacity: int, *, tokens_kept: bool) -> None:
    """Refuse sinks kept in every head that ``capacity`` tokens per head cannot hold: the ``prefix_tokens`` prefix
    with ``sink="prefix"``, and with ``tokens_kept`` (kvzip-head, whose sinks score +inf) the ``n_sink`` tokens."""
    prefix = params["sink"] == "prefix"
    param = "prefix_tokens" if prefix else "n_sink"
    if (prefix or tokens_kept) and int(params[param]) > int(capacity):
        raise ParamError(param, f"rule '{name}': parameter '{param}' is {int(params[param])} but the capacity is "
                                f"{int(capacity)} tokens per KV head, and sink=\"{params['sink']}\" keeps those "
                                f"{param} tokens in every head; lower {param} to at most {int(capacity)} or raise "
                                f"the capacity")


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
    signal = "none"
    shared_across_heads = False
    chunk_size: int = param(2048, low=1, high=1 << 20, description="context tokens per chunk")
    carry_tokens: int = param(8, low=0, high=1 << 12,
                              description="previous chunk's last ids repeated in the next prompt")
    sink: str = param("tokens", choices=SINKS, description="attention sinks: n_sink tokens or the prefix")
    n_sink: int = param(4, low=0, high=1 << 20, description="attention-sink tokens")
    prefix_tokens: int = param(0, low=0, high=1 << 30, description="prompt tokens before the context")
    repeat_ids: list[int] | None = _ids_param("the first chunk's prompt")
    continue_ids: list[int] | None = _ids_param("later chunks' prompt")
    # a tokenizer may spell the plain "\n" header as no tokens: the chunk then follows the prompt directly
    suffix_ids: list[int] | None = _ids_param("the assistant header", min_items=0)
    paper = ("Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
             "(arXiv:2505.23416)")
    tokenizer_params = PROMPT_PARAMS

    @classmethod
    def params_for_tokenizer(cls, tokenizer) -> dict:
        return prompt_params(tokenizer)

    def check_capacity(self, capacity: int) -> None:
        check_sink_capacity(self.name, self.params, capacity, tokens_kept=False)

    def new_state(self) -> ReconstructionScores:
        return ReconstructionScores(sink=self.sink, n_sink=self.n_sink, prefix_tokens=self.prefix_tokens)

    def probe_chunks(self, prompt_ids: torch.Tensor) -> list[probe.ProbeChunk]:
        """``P_i + suffix + c_i`` for each context chunk c_i of ``prompt_ids`` [B, T] after the prefix."""
        missing = [k for k in PROMPT_PARAMS if getattr(self, k) is None]
        if missing:
            raise ValueError(f"parameters {missing} are not set: they hold the token ids of the reconstruction "
                             f"prompts for this model's tokenizer; pass polykv.apply(model, plan, tokenizer=tok) "
                             f"(or set them from polykv.adapters.rules.kvzip.prompt_params(tokenizer))")
        B, T = prompt_ids.shape
        prefix, size, carry = int(self.prefix_tokens), int(self.chunk_size), int(self.carry_tokens)
        if prefix >= T:
            raise ValueError(f"parameter 'prefix_tokens' is {prefix} but the prompt has {T} tokens: no context is left "
                             f"to reconstruct")

        def row(ids):
            return torch.tensor(ids, dtype=torch.long, device=prompt_ids.device).view(1, -1).expand(B, -1)

        repeat, cont, suffix = row(self.repeat_ids), row(self.continue_ids), row(self.suffix_ids)
        prompt_ids = prompt_ids.long()
        out, prev = [], None
        for i, start in enumerate(range(prefix, T, size)):
            end = min(start + size, T)
            chunk = prompt_ids[:, start:end]
            head = repeat if prev is None else torch.cat([cont, prev[:, prev.shape[1] - min(carry, prev.shape[1]):]], 1)
            out.append(probe.ProbeChunk(ids=torch.cat([head, suffix, chunk], dim=1), span=(start, end), index=i))
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

    def bound(self, capacities, context_tokens: int) -> list[int]:
        """One head may take the whole prompt: its budget is a share of ``total x Hkv`` tokens, not of ``total``."""
        return [int(context_tokens) for _ in capacities]

    def layer_statistic(self, ctx) -> torch.Tensor:
        state = ctx.state.component(ReconstructionScores) if ctx.state is not None else None
        if state is None or state.scores is None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'kvzip' ranks the reconstruction scores of rule "
                             f"'kvzip', but this layer's prefill rule is not kvzip (route the group's layers to it)")
        if ctx.valid is not None:
            raise ValueError(f"layer {ctx.layer_idx}: allocator 'kvzip' cannot read a ragged layer")
        return state.scores[0]                                                   # (Hkv, T)

    def allocate(self, request: allocators.AllocationRequest) -> torch.Tensor:
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
