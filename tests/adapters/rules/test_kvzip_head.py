"""KVzip at head level (rule and allocator ``kvzip-head``): the head scores from one calibration context through
the probe path against the reference code's scoring, the score file, and whole heads kept or dropped."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.adapters.rules.kvzip import KVzipRule, prompt_params
from polykv.adapters.rules.kvzip_head import CALIBRATION_SINK, compute_head_scores
from polykv.runtime.session import run_probe
from polykv.models.geometry import geometry_of_model
from polykv.adapters.rules.kvzip_heads import HeadScores
from polykv.plan import AllocationGroup, OpSpec
from polykv.testing import tiny_model, token_ids
from tests.adapters.rules.test_kvzip import reference_scores


class Tok:
    """A tokenizer without a chat template whose ids fit the tiny models' vocabulary."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 97 for ch in text]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)


def test_head_scores_are_the_max_reconstruction_probability_of_the_reference(model):
    batches = [token_ids(1, 30, seed=1), token_ids(1, 25, seed=2)]
    got = compute_head_scores(model, batches, tokenizer=Tok(), run_probe=run_probe, chunk_size=20)
    ids = torch.cat(batches, dim=1)
    params = dict(prompt_params(Tok()), chunk_size=20, n_sink=CALIBRATION_SINK, prefix_tokens=CALIBRATION_SINK)
    chunks = [(c.span[0], c.span[1], c.ids) for c in KVzipRule(**params).probe_chunks(ids)]
    want = reference_scores(model, ids, chunks, sink_of=lambda start: min(CALIBRATION_SINK, start),
                            init=lambda s: s)[..., CALIBRATION_SINK:].amax(-1)          # (L, Hkv)
    assert got.scores.shape == (3, 2) and got.num_tokens == 55 - CALIBRATION_SINK
    assert torch.allclose(got.scores.double(), want, atol=1e-6)
    assert got.fingerprint == geometry_of_model(model).fingerprint
    assert len(set(got.scores.flatten().tolist())) == 6   # heads differ: a ranking exists


def test_score_file_round_trips_and_refuses_another_model(model, tmp_path):
    data = HeadScores.measured(torch.tensor([[0.5, 0.2], [0.9, 0.1], [0.3, 0.4]]), model, num_tokens=10)
    path = tmp_path / "m.kvzip-heads.safetensors"
    data.save(path)
    back = HeadScores.load(path)
    assert torch.equal(back.scores, data.scores) and back.fingerprint == data.fingerprint
    back.check_model(model)
    other = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16, seed=1, vocab=130)
    with pytest.raises(Exception) as err:
        back.check_model(other)
    msg = str(err.value)
    assert str(path) in msg and data.fingerprint in msg and geometry_of_model(other).fingerprint in msg
    assert "recompute" in msg and "\n" not in msg


def _plan(model, ratio, **params):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip-head", capacity_ratio=ratio, params=params),
                               decode="full")
    return attrs.evolve(plan, allocation=(AllocationGroup(allocator="kvzip-head", layers=(0, 1, 2)),))


SCORES = torch.tensor([[0.5, 0.2], [0.9, 0.1], [0.3, 0.4]])


def test_a_global_threshold_keeps_or_drops_whole_heads(model):
    data = HeadScores.measured(SCORES, model, num_tokens=10)
    ids = token_ids(1, 40, seed=4)
    plan = _plan(model, 0.5, n_sink=3)
    # budget 0.5 x 40 x 3 layers x 2 heads = 120 tokens; every head keeps its 3 sinks (18), then whole heads in
    # score order (0.9, 0.5, 0.4, ...) while the 37 extra tokens of each fit: 18 + 37 + 37 = 92, a third 129 > 120
    with torch.no_grad(), polykv.apply(model, plan, model_data={"kvzip-head": data}) as session:
        session.prefill(ids)
        counts = session.cache.head_counts()
        positions = [[sorted(int(p) for p in layer.storage.view().positions[0, h] if p >= 0) for h in range(2)]
                     for layer in session.cache.layers]
    assert [[int(c) for c in row] for layer in counts for row in layer] == [[40, 3], [40, 3], [3, 3]]
    assert positions[1][0] == list(range(40)) and positions[0][1] == [0, 1, 2] and positions[2][1] == [0, 1, 2]


def test_prefix_sink_keeps_the_prefix_in_dropped_heads(model):
    data = HeadScores.measured(SCORES, model, num_tokens=10)
    with torch.no_grad(), polykv.apply(model, _plan(model, 0.3, sink="prefix", prefix_tokens=6),
                                       model_data={"kvzip-head": data}) as session:
        session.prefill(token_ids(1, 40, seed=4))
        counts = session.cache.head_counts()
    # 0.3 x 40 x 6 heads = 72: six heads keep their 6-token prefix (36), one head adds 34 (70), a second does not fit
    assert [[int(c) for c in row] for layer in counts for row in layer] == [[6, 6], [40, 6], [6, 6]]


def test_alone_each_layer_keeps_whole_heads_by_its_own_threshold(model):
    """Without the allocator a layer's budget (capacity x Hkv) goes to whole heads in its own score order."""
    geo = geometry_of_model(model)
    data = HeadScores.measured(SCORES, model, num_tokens=10)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip-head", capacity=22, params={"n_sink": 3}),
                               decode="full")
    with torch.no_grad(), polykv.apply(model, plan, model_data={"kvzip-head": data}) as session:
        session.prefill(token_ids(1, 40, seed=4))
        counts = session.cache.head_counts()
    # 22 x 2 = 44 tokens per layer: both heads keep 3 sinks (6), the better head adds 37 (43), the other cannot
    assert [[int(c) for c in row] for layer in counts for row in layer] == [[40, 3], [40, 3], [3, 40]]


def test_missing_scores_are_computed_through_the_probe_and_cached(model, monkeypatch):
    import pathlib

    import polykv.contract.model_data as md
    from polykv.contract.model_data import ModelDataNote

    monkeypatch.setattr(md, "CORPUS_TOKENS", 24)
    plan = _plan(model, 0.5)
    with pytest.warns(ModelDataNote, match="kvzip head scores"), torch.no_grad(), \
            polykv.apply(model, plan, tokenizer=Tok()) as session:
        session.prefill(token_ids(1, 30, seed=4))
        got = session.model_data["kvzip-head"]
    assert [p.name for p in pathlib.Path(md.cache_dir()).rglob("*.kvzip-heads.safetensors")] == \
        ["kvzip-head.kvzip-heads.safetensors"]
    batches = md.corpus_batches(Tok(), "cpu")
    assert torch.allclose(got.scores, compute_head_scores(model, batches, tokenizer=Tok(), run_probe=run_probe).scores)
