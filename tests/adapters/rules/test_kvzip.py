"""KVzip (adapters/rules/kvzip.py): the probe it builds, its scores against a loop-by-loop reference of the
reference code's scoring (snu-mllab/KVzip attention/score.py ``_get_score``; kvpress ``score_kvzip``) on a
tiny model, and the tokens it keeps."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import polykv
from polykv.adapters.rules.kvzip import KVzipRule, prompt_params
from polykv.plan import OpSpec
from polykv.runtime.cache import cache_keyword
from polykv.plugin_checks import check_rule
from polykv.testing import tiny_model, token_ids
from polykv.models.geometry import geometry_of_model

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def test_probe_chunks_follow_the_reference_prompts():
    rule = KVzipRule(**IDS, chunk_size=4, carry_tokens=2, prefix_tokens=3)
    ids = torch.arange(100, 113).view(1, 13)                       # prefix 100-102, context 103-112
    chunks = rule.probe_chunks(ids)
    assert [c.span for c in chunks] == [(3, 7), (7, 11), (11, 13)]
    assert chunks[0].ids.tolist() == [[5, 6, 7, 10, 11, 103, 104, 105, 106]]
    assert chunks[1].ids.tolist() == [[8, 9, 105, 106, 10, 11, 107, 108, 109, 110]]
    assert chunks[2].ids.tolist() == [[8, 9, 109, 110, 10, 11, 111, 112]]
    assert KVzipRule(**IDS, carry_tokens=0, chunk_size=4).probe_chunks(ids)[1].ids.tolist() == \
        [[8, 9, 10, 11, 104, 105, 106, 107]]


_CAPTURED: list = []


def _capture(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED.append((module.layer_idx, query.detach().clone(), key.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def reference_scores(model, ids, chunks, *, sink_of, init):
    """The reference code's scoring, loop by loop: a vanilla prefill, then every repeat chunk on a copy of the
    full cache; per layer, KV head, query head of its group and repeat query, a float64 softmax over
    [sink | the chunk's keys | the repeat keys up to the query]; the max over heads and queries."""
    AttentionInterface.register("kvzip-capture", _capture)
    AttentionMaskInterface.register("kvzip-capture", sdpa_mask)
    cfg = model.config
    saved = cfg._attn_implementation
    cfg._attn_implementation = "kvzip-capture"
    try:
        with torch.no_grad():
            cache = DynamicCache(config=cfg)
            kw = cache_keyword(model)
            model(ids, use_cache=True, **{kw: cache})
            T = ids.shape[1]
            L, Hkv, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
            G, d = H // Hkv, cfg.head_dim
            scores = init(torch.zeros(L, Hkv, T, dtype=torch.float64))
            for start, end, rep in chunks:
                _CAPTURED.clear()
                model(rep, use_cache=True, **{kw: copy.deepcopy(cache)})
                n = rep.shape[1]
                for layer, query, key in _CAPTURED:
                    sink = sink_of(start)
                    for h in range(Hkv):
                        keys = torch.cat([key[0, h, :sink], key[0, h, start:end], key[0, h, T:]]).double()
                        best = torch.zeros(end - start, dtype=torch.float64)
                        for g in range(G):
                            for i in range(n):
                                logits = keys @ query[0, h * G + g, i].double() / d ** 0.5
                                logits[sink + end - start + i + 1:] = float("-inf")      # causal on the repeat block
                                probs = torch.softmax(logits, dim=0)
                                best = torch.maximum(best, probs[sink:sink + end - start])
                        scores[layer, h, start:end] = best
    finally:
        cfg._attn_implementation = saved
    return scores


def runtime_scores(model, plan, ids, monkeypatch):
    got = {}
    original = KVzipRule.score

    def recording(self, ctx):
        out = original(self, ctx)
        got[ctx.layer_idx] = out.clone()
        return out

    monkeypatch.setattr(KVzipRule, "score", recording)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids)
        kept = [layer.storage.view().positions[0] for layer in session.cache.layers]
    return torch.stack([got[i][0] for i in sorted(got)]).double(), kept


@pytest.mark.parametrize("sink", ["tokens", "prefix"])
def test_scores_and_kept_tokens_equal_the_reference(model, sink, monkeypatch):
    geo = geometry_of_model(model)
    ids = token_ids(1, 45, seed=3)
    params = dict(IDS, chunk_size=16, carry_tokens=4, n_sink=3, prefix_tokens=5, sink=sink)
    capacity = 14
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=capacity, params=params), decode="full")
    chunks = [(c.span[0], c.span[1], c.ids) for c in KVzipRule(**params).probe_chunks(ids)]
    if sink == "tokens":  # kvpress: min(n_sink, chunk start) sink keys; the first n_sink tokens score 1, others 0
        def init(s):
            s[..., :3] = 1.0
            return s
        want = reference_scores(model, ids, chunks, sink_of=lambda start: min(3, start), init=init)
    else:  # the reference code: the whole prefix is the sink and is always kept
        def init(s):
            s[..., :5] = float("inf")
            return s
        want = reference_scores(model, ids, chunks, sink_of=lambda start: 5, init=init)
    got, kept = runtime_scores(model, plan, ids, monkeypatch)
    assert got.shape == want.shape == (2, 2, 45)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert torch.allclose(got[finite], want[finite], atol=1e-6, rtol=1e-5)
    assert float(want[finite].max()) > 0.05  # the scores are attention probabilities, not all zero
    ref_kept = want.topk(capacity, dim=-1).indices.sort(dim=-1).values   # top int(T * r) per layer and head
    for layer in range(2):
        assert torch.equal(kept[layer], ref_kept[layer])


def test_prompt_params_builds_ids_from_a_tokenizer():
    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [ord(ch) for ch in text]

    got = prompt_params(Tok())
    assert got["repeat_ids"] == [ord(c) for c in "\n\nRepeat the previous context exactly."]
    assert got["continue_ids"][-4:] == [ord(c) for c in "with"]
    assert got["suffix_ids"] == [10]


def test_check_rule_runs_kvzip_through_its_probe():
    assert check_rule(KVzipRule, dict(IDS, chunk_size=16))["prefill"] == 2


def test_plan_show_states_the_probe_cost_and_the_plan_round_trips(model, tmp_path):
    from polykv.commands.plan import format_plan
    from polykv.plan.writing import save

    geo = geometry_of_model(model)
    params = dict(IDS, chunk_size=1000)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity_ratio=0.3, params=params), decode="full")
    path = tmp_path / "kvzip.plan.json"
    save(plan, str(path))
    loaded = polykv.load_plan(str(path))
    assert loaded.layers[0].prefill.params == params
    line = next(x for x in format_plan(loaded, str(path), 2500).splitlines() if x.startswith("probe"))
    # three chunks of 1000, 1000, 500 tokens: (3 + 2) + (2 + 8 + 2) + (2 + 8 + 2) prompt ids + 2500 context ids
    assert "rule 'kvzip' (layers 0-1)" in line and "2529 extra forward tokens (1.01x the prompt)" in line
    bare = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity_ratio=0.3), decode="full")
    assert "cannot run as given: parameters ['repeat_ids'" in format_plan(bare, "b.json", 100)


def test_global_budget_keeps_the_group_wide_top_scores_in_ragged_heads(model):
    """Allocator 'kvzip' (the reference's ``pair`` level): one ranking over layers x heads x tokens; each head
    stores exactly its tokens among the group's top total x Hkv (ragged storage, the rest freed)."""
    import attrs

    from polykv.plan import AllocationGroup

    geo = geometry_of_model(model)
    ids = token_ids(1, 45, seed=3)
    params = dict(IDS, chunk_size=16, carry_tokens=4, n_sink=3, prefix_tokens=5)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity=12, params=params), decode="full")
    plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="kvzip", layers=(0, 1)),))
    chunks = [(c.span[0], c.span[1], c.ids) for c in KVzipRule(**params).probe_chunks(ids)]

    def init(s):
        s[..., :3] = 1.0
        return s

    want = reference_scores(model, ids, chunks, sink_of=lambda start: min(3, start), init=init)   # (L, Hkv, T)
    keep = 12 * 2 * 2                                                  # total (12 per head x 2 layers) x Hkv
    top = want.flatten().topk(keep).indices
    ref = torch.zeros(want.numel(), dtype=torch.bool)
    ref[top] = True
    ref = ref.view_as(want)
    assert bool(ref.any(-1).all())   # (every head holds a top score here, so the at-least-one rule does not bind)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids)
        cache = session.cache
        counts = cache.head_counts()
        got = [[sorted(int(p) for p in layer.storage.view().positions[0, h] if p >= 0) for h in range(2)]
               for layer in cache.layers]
        stored = session.resident_bytes().per_layer
    assert sum(c for layer in counts for row in layer for c in row) == keep
    assert [[c for c in row] for layer in counts for row in layer] == [ref[l].sum(-1).tolist() for l in range(2)]
    assert counts[0][0] != counts[1][0] or counts[0][0][0] != counts[0][0][1]   # budgets differ across heads/layers
    for layer in range(2):
        for h in range(2):
            assert got[layer][h] == ref[layer, h].nonzero().flatten().tolist()
    assert sum(stored) > 0


def test_scores_in_query_row_chunks_equal_one_chunk(monkeypatch):
    """reconstruction_scores runs query rows in chunks; a chunk of one row gives the one-chunk scores."""
    import polykv.adapters.rules.kvzip as kvzip

    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 30 + 9, 8, generator=g)
    whole = kvzip.reconstruction_scores(query, keys, (10, 22), 3, 0.35)
    monkeypatch.setattr(kvzip, "SCORE_CHUNK_ELEMENTS", 1)
    rows = kvzip.reconstruction_scores(query, keys, (10, 22), 3, 0.35)
    assert whole.shape == (2, 2, 12) and torch.allclose(rows, whole, atol=1e-7, rtol=1e-6)
    assert float(whole.min()) > 0 and float(whole.max()) <= 1


def test_global_budget_bound_covers_one_head_taking_the_whole_prompt():
    """The group keeps total x Hkv tokens ranked over every head: one head may hold more than ``total`` (up to the
    prompt), so the memory model's per-head bound is the prompt, not min(total, prompt)."""
    from polykv.adapters.rules.kvzip import KVzipAllocator
    from polykv.contract.allocators import AllocationRequest

    T, Hkv = 45, 2
    scores = torch.rand(2, Hkv, T) * 0.1
    scores[0, 0] += 1.0                                               # layer 0, head 0 ranks above everything else
    request = AllocationRequest(group_layers=(0, 1), layers=(0, 1), statistics=tuple(scores), total=24,
                                capacities=(12, 12), context_tokens=T, num_kv_heads=Hkv, final=True)
    counts = KVzipAllocator().allocate(request)
    assert int(counts.sum()) == 24 * Hkv and int(counts[0, 0]) == T   # more than total = 24 tokens in one head
    assert all(int(counts[i].max()) <= b for i, b in enumerate(KVzipAllocator().bound((12, 12), T)))
