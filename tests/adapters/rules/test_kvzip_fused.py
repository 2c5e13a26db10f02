"""KVzip's probe attends and scores in one pass (adapters/rules/kvzip.py ``attend_and_score``): its attention
output is SDPA's and its scores are those of the kept reference ``reconstruction_scores`` (the scoring that
re-read the probe's keys after the attention), on random tensors and through the runtime on a tiny model."""

from __future__ import annotations

import pytest
import torch

import polykv
import polykv.adapters.rules.kvzip as kvzip
from polykv.adapters.rules.kvzip import KVzipRule, ReconstructionScores, attend_and_score, reconstruction_scores
from polykv.attention.kernels import sdpa
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.testing import tiny_model, token_ids

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


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


def test_a_subset_far_below_the_rows_maximum_keeps_its_scores_and_the_output():
    """The score's softmax is taken against its own subset's maximum: a context chunk attended 100 logits less
    than another part of the prompt still scores its own probabilities (no underflow to 0), and the output
    is SDPA's."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 6, 4, generator=g)
    keys, values = torch.randn(1, 1, 20 + 6, 4, generator=g), torch.randn(1, 1, 20 + 6, 4, generator=g)
    keys[:, :, 14:18] = query[0, 0, 0] * 60      # prompt tokens 14..17, outside the span, dominate every row
    out, scores = attend_and_score(query, keys, values, (2, 10), 2, 1.0)
    want = reconstruction_scores(query, keys, (2, 10), 2, 1.0)
    assert float(want.min()) > 0 and torch.allclose(scores, want, atol=0, rtol=1e-5)
    assert torch.allclose(out, sdpa(query, keys, values, 1.0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sink", ["tokens", "prefix"])
def test_the_runtime_keeps_the_tokens_of_the_reference_scoring(sink, monkeypatch):
    """Through polykv.apply: the scores and the kept tokens are those of the reference path (the runtime's SDPA,
    then reconstruction_scores in observe), and the one-pass attention served every probe forward."""
    model = tiny_model("llama", layers=3, heads=6, kv_heads=2, head_dim=16)
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
    fused, kept, logits = run()
    assert calls == [0] * 3 + [1] * 3 + [2] * 3     # each chunk (70 - 5 tokens in 24s) through the 3 layers
    monkeypatch.delattr(ReconstructionScores, "attend_probe")
    reference, ref_kept, ref_logits = run()
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(fused)) and float(reference[finite].max()) > 0.05
    assert torch.allclose(fused[finite], reference[finite], atol=1e-7, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    assert torch.allclose(logits, ref_logits, atol=1e-5)
