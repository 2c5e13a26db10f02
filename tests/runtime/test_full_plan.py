"""The keep-everything 16-bit plan reproduces vanilla transformers exactly (tokens) and to 1e-4 (logits)."""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model
from polykv.runtime.cache import cache_keyword, output_cache

TOL = 1e-4
STEPS = 64


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param, layers=2, heads=4, kv_heads=2, head_dim=16)


def _greedy_manual(model, ids, steps, cache_kw):
    """Prefill + ``steps`` greedy decode steps; returns (tokens [B, steps], logits [steps + 1, B, V])."""
    out = model(ids, use_cache=True, **cache_kw)
    cache = output_cache(out)
    logits, toks = [out.logits[:, -1]], []
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        toks.append(tok)
        out = model(tok, use_cache=True, **{cache_keyword(model): cache})
        logits.append(out.logits[:, -1])
    return torch.cat(toks, dim=1), torch.stack(logits)


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_matches_vanilla(model, prompt, batch):
    ids = prompt(batch, 24, seed=batch)
    kwargs = dict(max_new_tokens=STEPS, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with polykv.apply(model, polykv.full_plan(geometry_of_model(model))) as session:
            got = model.generate(ids, **kwargs)
            assert session.cache.get_seq_length() == 24 + STEPS - 1
    assert torch.equal(got.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores))
    assert diff < TOL


@pytest.mark.parametrize("batch", [1, 2])
def test_manual_loop_logits_match_vanilla(model, prompt, batch):
    ids = prompt(batch, 31, seed=10 + batch)
    with torch.no_grad():
        ref_prefill = model(ids).logits
        ref_toks, ref_logits = _greedy_manual(model, ids, STEPS, {})
        with polykv.apply(model, polykv.full_plan(geometry_of_model(model))) as session:
            got_prefill = model(ids, **{cache_keyword(model): session.new_cache()}, use_cache=True).logits
            toks, logits = _greedy_manual(model, ids, STEPS, {cache_keyword(model): session.new_cache()})
    assert (got_prefill - ref_prefill).abs().max() < TOL          # every prompt row
    assert torch.equal(toks, ref_toks)
    assert (logits - ref_logits).abs().max() < TOL                # prefill last row + every decode step


def test_chunked_prefill_and_multi_token_decode_match_vanilla(model, prompt):
    ids = prompt(2, 40, seed=3)
    with torch.no_grad():
        ref = model(ids).logits
        with polykv.apply(model, polykv.full_plan(geometry_of_model(model))) as session:
            out = session.prefill(ids[:, :30], chunk_size=7)
            assert (out.logits - ref[:, 28:30]).abs().max() < TOL   # last chunk is 2 tokens (28, 29)
            more = model(ids[:, 30:], **{cache_keyword(model): session.cache}, use_cache=True).logits
    assert (more - ref[:, 30:]).abs().max() < TOL


def test_model_is_restored_after_the_block(model, prompt):
    ids = prompt(1, 12)
    before_impl = model.config._attn_implementation
    with torch.no_grad():
        ref = model(ids).logits
        with polykv.apply(model, polykv.full_plan(geometry_of_model(model))):
            assert model.config._attn_implementation == "polykv"
            assert "generate" in model.__dict__
        assert model.config._attn_implementation == before_impl
        assert all(getattr(m, "config", model.config)._attn_implementation == before_impl for m in model.modules())
        assert "generate" not in model.__dict__
        assert torch.equal(model(ids).logits, ref)
