"""Runtime invariants: positions, capacity, memory accounting, model families, and clear errors."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.memory import predict_resident
from polykv.plan import OpSpec
from polykv.attention.signals import attention_column_sums
from polykv.testing import tiny_model
from polykv.runtime.cache import cache_keyword

KIVI = {"group_size": 16, "residual": 16}


def _decode(model, cache, first, steps):
    out, tok = None, first
    for _ in range(steps):
        out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
    return out


def test_positions_continue_at_tokens_seen_and_capacity_holds(llama, prompt):
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=8),
                               decode=OpSpec(rule="h2o", capacity=10), decode_slack=3)
    ids = prompt(2, 30)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        cache = session.new_cache()
        model(ids, **{cache_keyword(model): cache}, use_cache=True)
        assert cache.stored_tokens() == [8, 8] and cache.get_seq_length() == 30
        tok = ids[:, -1:]
        for step in range(20):
            seen = cache.get_seq_length()
            out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                assert layer.tokens_seen == seen + 1
                assert layer.num_stored() <= 10 + 3
                # The newest token is stored at position = tokens seen before it, whatever was evicted.
                assert bool((layer.positions[..., -1] == seen).all())
                assert bool((layer.positions.diff(dim=-1) > 0).all())
                assert len(layer.key_store) == len(layer.value_store) == layer.num_stored()
        assert cache.get_seq_length() == 50


def test_resident_bytes_match_the_memory_model(llama, prompt):
    model, geo = llama
    layers = [
        {"prefill": OpSpec(rule="snapkv", capacity=40, params={"window": 8}), "decode": OpSpec(rule="tova", capacity=40),
         "k_bits": 4, "v_bits": 8, "quantizer_params": KIVI},
        {"prefill": OpSpec(rule="h2o", capacity_ratio=0.5), "decode": OpSpec(rule="h2o", capacity_ratio=0.5)},
    ]
    plan = polykv.per_layer_plan(geo, layers)
    ids = prompt(2, 96)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(ids, chunk_size=40)
        got = session.resident_bytes()
    want = predict_resident(plan, geo, 96, batch=2, dtype_bytes=4)
    assert list(got.per_layer) == [r.resident_bytes for r in want]
    assert [dict(m) for m in got.metadata_per_layer] == [r.metadata for r in want]
    assert got.total == sum(r.resident_bytes for r in want)
    # K+V, B=2, Hkv=2, d=16, fp32: 48 kept in buffers of 48 + slack 128 + 1 rows (the decode op evicts)
    assert got.per_layer[1] == 2 * 2 * 2 * (48 + 128 + 1) * 16 * 4
    assert got.metadata_per_layer[1]["accumulated"] == 2 * 2 * 48 * 4


def test_quantization_error_does_not_compound_under_repeated_eviction(llama, prompt):
    """A stored token's dequantized K/V changes at most once (full-precision residual -> codes), however
    many evictions it survives."""
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="tova", capacity=12), decode_slack=1, k_bits=4, v_bits=4,
                               quantizer_params={"group_size": 4, "residual": 4})
    history: dict[tuple, list[torch.Tensor]] = {}
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt(1, 16, seed=6))
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(30):
            out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for li, layer in enumerate(session.cache.layers):
                k, v = layer.key_store.dequantize(), layer.value_store.dequantize()
                for h in range(geo.num_kv_heads):
                    for t, pos in enumerate(layer.positions[0, h].tolist()):
                        for stream, x in (("k", k), ("v", v)):
                            seen = history.setdefault((li, h, pos, stream), [])
                            if not seen or not torch.equal(seen[-1], x[0, h, t]):
                                seen.append(x[0, h, t].clone())
    survivors = [vals for vals in history.values()]
    assert max(len(v) for v in survivors) <= 2
    assert sum(len(v) == 2 for v in survivors) > 10      # many tokens went from residual to codes


def test_chunked_prefill_selects_like_one_shot_prefill(llama, prompt):
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=16), decode=OpSpec(rule="tova", capacity=16),
                               decode_slack=1)
    ids = prompt(1, 50, seed=9)
    results = []
    with torch.no_grad(), polykv.apply(model, plan) as session:
        for chunk in (None, 13):
            out = session.prefill(ids, chunk_size=chunk)
            positions = [layer.positions.clone() for layer in session.cache.layers]
            after = _decode(model, session.cache, out.logits[:, -1:].argmax(-1), 5)
            results.append((out.logits[:, -1], positions, after.logits))
    (a_log, a_pos, a_next), (b_log, b_pos, b_next) = results
    assert (a_log - b_log).abs().max() < 1e-4
    assert all(torch.equal(p, q) for p, q in zip(a_pos, b_pos))
    assert (a_next - b_next).abs().max() < 1e-4


def test_generate_continues_a_compressed_context_like_a_manual_loop(llama, prompt):
    """The evaluation protocol: compress the context, feed the question through the cache, generate."""
    model, geo = llama
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=12, params={"window": 4}),
                               decode=OpSpec(rule="tova", capacity=16), decode_slack=1)
    context, question = prompt(1, 40, seed=3), prompt(1, 5, seed=4)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(context)
        out = model.generate(torch.cat([context, question], 1), **{cache_keyword(model): session.cache},
                             max_new_tokens=6, do_sample=False)
        session.prefill(context)
        step = model(question, **{cache_keyword(model): session.cache}, use_cache=True)
        manual = []
        for _ in range(6):
            manual.append(step.logits[:, -1:].argmax(-1))
            step = model(manual[-1], **{cache_keyword(model): session.cache}, use_cache=True)
    assert torch.equal(out[:, 45:], torch.cat(manual, 1))


def test_accumulated_attention_equals_eager_column_sums(prompt):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 20, 8, generator=g)
    k = torch.randn(2, 3, 27, 8, generator=g)
    got = attention_column_sums(q, k, 0.3)
    # Reference: full [B, H, q, K] softmax with the q queries being the last q of the K positions.
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.3
    causal = torch.arange(27)[None, :] <= torch.arange(20)[:, None] + 7
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    want = probs.view(2, 3, 2, 20, 27).sum(dim=(2, 3))
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_same_plan_runs_on_every_family(family, prompt):
    model = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    layers = [{"prefill": OpSpec(rule="snapkv", capacity=12, params={"window": 4}),
               "decode": OpSpec(rule="h2o", capacity=12), "k_bits": 8, "v_bits": 4,
               "quantizer_params": KIVI},
              {"prefill": OpSpec(rule="streamingllm", capacity=12), "decode": OpSpec(rule="tova", capacity=12)}]
    plan = attrs.evolve(polykv.per_layer_plan(geo, layers, decode_slack=2),
                        model=attrs.evolve(polykv.per_layer_plan(geo, layers).model, fingerprint=None))
    ids = prompt(2, 32)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert out.shape == (2, 44)
        assert session.cache.get_seq_length() == 43
        assert all(n <= 14 for n in session.cache.stored_tokens())
        assert torch.isfinite(model(out[:, -1:], **{cache_keyword(model): session.cache}).logits).all()
    assert model.config._attn_implementation == "sdpa"


def test_plan_of_another_model_is_rejected(llama):
    model, geo = llama
    other = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(PlanError, match="3 layers|layers"):
        polykv.apply(model, polykv.full_plan(geometry_of_model(other)))
    same_shape = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=5)
    with pytest.raises(PlanError, match="fingerprint|made for model"):
        polykv.apply(model, polykv.full_plan(geometry_of_model(same_shape)))
    assert model.config._attn_implementation == "sdpa"


def test_quantizer_that_does_not_fit_the_head_dim_is_rejected_before_running(llama):
    model, geo = llama  # head_dim 16: KIVI's default group of 32 channels cannot split it
    plan = polykv.uniform_plan(geo, k_bits=4, v_bits=4)
    with pytest.raises(PlanError, match="layer 0.*quantizer_params"):
        polykv.apply(model, plan)
    assert model.config._attn_implementation == "sdpa"


def test_nested_session_on_the_same_model_is_rejected(llama):
    model, geo = llama
    with polykv.apply(model, polykv.full_plan(geo)):
        with pytest.raises(RuntimeConfigError, match="already inside"):
            polykv.apply(model, polykv.full_plan(geo))


def test_rule_in_unsupported_phase_is_rejected_before_running(llama):
    model, geo = llama
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="snapkv", capacity=8))
    with pytest.raises(PlanError, match="snapkv.*decode"):
        polykv.apply(model, plan)


def test_left_padding_is_rejected(llama, prompt):
    model, geo = llama
    ids = prompt(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with polykv.apply(model, polykv.full_plan(geo)) as session:
        with pytest.raises(RuntimeConfigError, match="padded"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(RuntimeConfigError, match="padded"):
            model(ids, attention_mask=mask, **{cache_keyword(model): session.new_cache()}, use_cache=True)


def test_forward_without_the_session_cache_is_rejected(llama, prompt):
    model, geo = llama
    with polykv.apply(model, polykv.full_plan(geo)):
        with pytest.raises(RuntimeConfigError, match="new_cache"):
            model(prompt(1, 6), use_cache=True)


def test_sliding_window_model_is_served_within_its_window(prompt):
    """Sliding-window layers are no longer refused: each keeps at most window - 1 tokens, exactly."""
    model = tiny_model("mistral", layers=2, heads=4, kv_heads=2, head_dim=16, sliding_window=8)
    ids = prompt(1, 20)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        with polykv.apply(model, polykv.full_plan(geometry_of_model(model))) as session:
            got = model.generate(ids, max_new_tokens=6, do_sample=False)
            assert session.cache.stored_tokens() == [7, 7]
    assert torch.equal(got, ref)


def test_unsupported_attention_implementation_is_rejected():
    model = tiny_model("llama", layers=2, attn_implementation="flex_attention")
    with pytest.raises(RuntimeConfigError, match="flex_attention"):
        polykv.apply(model, polykv.full_plan(geometry_of_model(model)))


def test_model_restored_even_when_the_block_raises(llama, prompt):
    model, geo = llama
    with pytest.raises(RuntimeError, match="boom"):
        with polykv.apply(model, polykv.full_plan(geo)):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__
