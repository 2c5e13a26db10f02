"""KVzip's probe attends and scores in one pass (adapters/rules/kvzip.py ``attend_and_score``): its attention
output is SDPA's and its scores are those of the kept reference ``reconstruction_scores`` (the scoring that
re-read the probe's keys after the attention), on random tensors and through the runtime on a tiny model."""

from __future__ import annotations

import contextlib

import pytest
import torch

import polykv
import polykv.adapters.rules.kvzip as kvzip
from polykv.adapters.rules.kvzip import (KVzipRule, ReconstructionScores, attend_and_score, reconstruction_scores,
                                         row_groups)
from polykv.attention.kernels import sdpa
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.testing import tiny_model, token_ids

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@contextlib.contextmanager
def intra_op_threads(threads: int):
    """torch's intra-op thread count set to ``threads`` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("span, sink", [((10, 22), 3), ((3, 30), 3), ((0, 12), 0), ((18, 30), 0), ((5, 30), 5)])
@pytest.mark.parametrize("block", [None, 1, 40])
def test_one_pass_equals_sdpa_and_the_reference_scores(span, sink, block, monkeypatch):
    if block is not None:  # blocks of one query row, or of a few, against one block of every row
        monkeypatch.setattr(kvzip, "PROBE_ATTENTION_ELEMENTS", block * 4 * (30 + 9))
    g = torch.Generator().manual_seed(sum(span) + sink)
    query = torch.randn(2, 4, 9, 8, generator=g)
    keys, values = torch.randn(2, 2, 30 + 9, 8, generator=g) * 2, torch.randn(2, 2, 30 + 9, 8, generator=g)
    out, scores = attend_and_score(query, keys, values, span, sink, 0.6)
    want = reconstruction_scores(query, keys, span, sink, 0.6)
    assert scores.shape == want.shape == (2, 2, span[1] - span[0])
    assert torch.allclose(scores, want, atol=1e-7, rtol=1e-5)
    assert torch.allclose(out, sdpa(query, keys, values, 0.6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("groups", [2, 3, 4])
@pytest.mark.parametrize("block", [None, 2, 5])
def test_rows_split_over_products_equal_sdpa_and_the_reference_scores(groups, block, monkeypatch):
    """A KV head's query rows run as ``groups`` products against copies of its keys (what several threads get):
    the output is SDPA's and the scores the reference's to float32 rounding, with blocks whose rows divide into the
    groups and a last block that does not (10 rows in blocks of a multiple of ``groups``)."""
    if block is not None:
        monkeypatch.setattr(kvzip, "PROBE_ATTENTION_ELEMENTS", block * 6 * (30 + 10))
    g = torch.Generator().manual_seed(groups)
    query = torch.randn(1, 6, 10, 8, generator=g)
    keys, values = torch.randn(1, 3, 30 + 10, 8, generator=g) * 2, torch.randn(1, 3, 30 + 10, 8, generator=g)
    out, scores = attend_and_score(query, keys, values, (10, 22), 3, 0.6, groups=groups)
    assert torch.allclose(scores, reconstruction_scores(query, keys, (10, 22), 3, 0.6), atol=1e-7, rtol=1e-5)
    assert torch.allclose(out, sdpa(query, keys, values, 0.6), atol=1e-6, rtol=1e-5)
    one_out, one_scores = attend_and_score(query, keys, values, (10, 22), 3, 0.6, groups=1)
    assert torch.allclose(scores, one_scores, atol=0, rtol=1e-6) and torch.allclose(out, one_out, atol=1e-6)


def test_row_groups_spread_the_kv_heads_evenly_over_the_threads():
    with intra_op_threads(2):
        assert [row_groups(items, "cpu") for items in (1, 2, 3, 6)] == [2, 1, 2, 1]
        assert row_groups(3, torch.device("cuda")) == 1
    with intra_op_threads(1):
        assert row_groups(3, "cpu") == 1
    with intra_op_threads(48):
        assert row_groups(3, "cpu") == kvzip.MAX_ROW_GROUPS


@pytest.mark.parametrize("lift", [30.0, 100.0])
def test_a_subset_far_below_the_rows_maximum_keeps_its_scores_and_the_output(lift, monkeypatch):
    """Every query attends prompt tokens outside the score's subset ``lift`` logits more than the rest: the
    subset's share of each row is small (lift 30: it divides out) or underflows float32 (lift 100: the block
    takes the subset's own softmax); either way the chunk scores its own probabilities, and the output is SDPA's."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, generator=g)
    query = base + 0.1 * torch.randn(1, 2, 6, 4, generator=g)
    keys, values = torch.randn(1, 1, 20 + 6, 4, generator=g), torch.randn(1, 1, 20 + 6, 4, generator=g)
    keys[:, :, 14:18] = base * lift / float(base.norm()) ** 2 * 2      # logit ~lift at scaling 1/2
    want = reconstruction_scores(query, keys, (2, 10), 2, 0.5)
    out, scores = attend_and_score(query, keys, values, (2, 10), 2, 0.5)
    assert float(want.min()) > 0 and torch.allclose(scores, want, atol=0, rtol=1e-5)
    assert torch.allclose(out, sdpa(query, keys, values, 0.5), atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(kvzip, "SUBSET_MASS_FLOOR", 0.0)             # the share alone, whatever it is
    _, shares = attend_and_score(query, keys, values, (2, 10), 2, 0.5)
    assert torch.allclose(shares, want, atol=0, rtol=1e-5) == (lift < 80)


@pytest.mark.parametrize("threads, kv_heads", [(1, 2), (2, 3)])   # (2, 3): two row groups per KV head
@pytest.mark.parametrize("sink", ["tokens", "prefix"])
def test_the_runtime_keeps_the_tokens_of_the_reference_scoring(sink, threads, kv_heads, monkeypatch):
    """Through polykv.apply: the scores and the kept tokens are those of the reference path (the runtime's SDPA,
    then reconstruction_scores in observe), and the one-pass attention served every probe forward; at two threads
    with 3 KV heads the probe's rows run as two products per head (:func:`row_groups`)."""
    model = tiny_model("llama", layers=3, heads=3 * kv_heads, kv_heads=kv_heads, head_dim=16)
    ids = token_ids(1, 70, seed=5)
    params = dict(IDS, chunk_size=24, carry_tokens=4, n_sink=3, prefix_tokens=5, sink=sink)
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzip", capacity=20, params=params),
                               decode="full")

    def run():
        got = {}
        original = KVzipRule.score

        def recording(self, ctx):
            got[ctx.layer_idx] = original(self, ctx).clone()
            return got[ctx.layer_idx]

        with monkeypatch.context() as m:
            m.setattr(KVzipRule, "score", recording)
            with torch.no_grad(), polykv.apply(model, plan) as session:
                logits = session.prefill(ids).logits[:, -1]
                kept = [layer.storage.view().positions for layer in session.cache.layers]
        return torch.stack([got[i] for i in sorted(got)]), kept, logits

    calls = []
    one_pass = ReconstructionScores.attend_probe

    def counted(self, *args):
        calls.append(args[4].index)
        return one_pass(self, *args)

    monkeypatch.setattr(ReconstructionScores, "attend_probe", counted)
    with intra_op_threads(threads):
        fused, kept, logits = run()
        assert calls == [0] * 3 + [1] * 3 + [2] * 3     # each chunk (70 - 5 tokens in 24s) through the 3 layers
        monkeypatch.delattr(ReconstructionScores, "attend_probe")
        reference, ref_kept, ref_logits = run()
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(fused)) and float(reference[finite].max()) > 0.05
    assert torch.allclose(fused[finite], reference[finite], atol=1e-7, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    assert torch.allclose(logits, ref_logits, atol=1e-5)


def test_bfloat16_probes_score_in_float32_and_attend_in_their_dtype():
    """A bfloat16 model's probe: the scores are the float32 scores of its bfloat16 queries and keys (as the
    reference's), the output is bfloat16 and within bfloat16 rounding of SDPA's."""
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 9, 8, generator=g).bfloat16()
    keys, values = torch.randn(1, 2, 39, 8, generator=g).bfloat16(), torch.randn(1, 2, 39, 8, generator=g).bfloat16()
    out, scores = attend_and_score(query, keys, values, (10, 22), 3, 0.35)
    assert out.dtype == torch.bfloat16 and scores.dtype == torch.float32
    assert torch.allclose(scores, reconstruction_scores(query, keys, (10, 22), 3, 0.35), atol=1e-7, rtol=1e-5)
    assert torch.allclose(out.float(), sdpa(query, keys, values, 0.35).float(), atol=2e-2)
