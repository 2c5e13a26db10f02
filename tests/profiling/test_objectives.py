"""Calibration objectives: the follow-up builders, the measured tables against an independent runtime measurement,
the mixed routing table, and the retrieval items' disjointness from every synthetic study task."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch

from polykv.errors import ProfileError, StudyError
from polykv.models.corpus import _code_documents, _prose_documents, reserved_text
from polykv.models.geometry import geometry_of_model
from polykv.profiling import endtoend as e2e
from polykv.profiling import objectives as ob
from polykv.profiling import validation as val
from polykv.profiling.calibrate import calibrate
from polykv.profiling.profile import loads
from polykv.registry import get_registry
from polykv.studies.tasks import WhitespaceTokenizer

PREFIX = 160


class Words:
    """A word-level tokenizer over the tiny model's 128 ids (crc32 of each word), no chat template."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [zlib.crc32(w.encode()) % 127 + 1 for w in text.split()]


def _held(n: int = 2, length: int = 200, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (length,), generator=g) for _ in range(n)]


# -- builders ------------------------------------------------------------------------------------------------------

def test_continuation_scores_every_follow_up_position():
    (item,) = ob.continuation(_held(1), PREFIX)
    assert item.rows == tuple(range(200 - PREFIX - 1))
    assert torch.equal(item.scored_ids, item.ids[PREFIX + 1:])


def test_reconstruction_scores_exactly_the_chunk_tokens_at_start_middle_and_end():
    rule = ob.reconstruction_rule(get_registry(), Words(), chunk_tokens=32)
    held = _held()
    items = ob.reconstruction(held, PREFIX, rule)
    assert len(items) == 6 and [i.span for i in items[:3]] == [(0, 32), (64, 96), (128, 160)]
    prompt = Words().encode("\n\nRepeat the previous context exactly.")  # kvzip's wording, through its probe
    for item in items:
        start, end = item.span
        s = held[items.index(item) // 3]
        assert torch.equal(item.ids[:PREFIX], s[:PREFIX])
        assert torch.equal(item.scored_ids, s[start:end])            # the scored tokens are the chunk, and only it
        assert len(item.rows) == end - start and item.depth == start / PREFIX
    assert items[0].ids[PREFIX:PREFIX + len(prompt)].tolist() == prompt
    again = ob.reconstruction(held, PREFIX, rule)
    assert all(torch.equal(a.ids, b.ids) and a.rows == b.rows for a, b in zip(items, again))


def _template(item):
    """The template whose fact ``item`` asks about."""
    return next(t for t in ob.TEMPLATES
                if re.fullmatch(re.escape(t.fact).replace(r"\{key\}", ".+").replace(r"\{value\}", ".+"), item.fact))


def test_retrieval_facts_are_in_the_prefix_at_the_stated_depths_and_only_answers_are_scored():
    tok = Words()
    held = ob.haystacks(2, PREFIX, tok.encode, seed=5)
    items = ob.retrieval(2, PREFIX, tok.encode, seed=5)
    assert len(items) == 8 and len({i.answer for i in items}) > 1
    for item in items:
        assert item.ids[:PREFIX].numel() == PREFIX
        start, end = item.span
        assert item.ids[start:end].tolist() == tok.encode(" " + item.fact + "\n")     # the fact is where it says
        assert item.answer in item.fact
        assert item.depth == start / PREFIX and 0.04 <= item.depth <= 0.96
        assert item.scored_ids.tolist() == tok.encode(" " + item.answer)               # only the answer is scored
        assert len(item.rows) == len(tok.encode(" " + item.answer))
    for seq in range(2):
        mine = items[4 * seq:4 * seq + 4]
        depths = [i.depth for i in mine]
        assert depths == sorted(depths) and depths[-1] - depths[0] > 0.6     # spread from near the start to the end
        assert len({ob.TEMPLATES.index(_template(i)) for i in mine}) == 4
        for i in mine:                                                       # every fact is in every item's prefix
            assert i.ids[:PREFIX].tolist() == mine[0].ids[:PREFIX].tolist()
        filler = held[seq][:PREFIX - sum(e - s for s, e in (i.span for i in mine))].tolist()
        kept = [t for k, t in enumerate(mine[0].ids[:PREFIX].tolist())
                if not any(s <= k < e for s, e in (i.span for i in mine))]
        assert kept == filler                                                # the rest is the haystack, in order
    same = ob.retrieval(2, PREFIX, tok.encode, seed=5)
    other = ob.retrieval(2, PREFIX, tok.encode, seed=6)
    assert all(torch.equal(a.ids, b.ids) and a.rows == b.rows for a, b in zip(items, same))
    assert not all(torch.equal(a.ids, b.ids) for a, b in zip(items, other))


@pytest.mark.parametrize("names, weights, match", [
    (["gist"], {}, "unknown"), ([], {}, "none given"), (["continuation"], {"retrieval": 1.0}, "not among"),
    (["continuation", "retrieval"], {"retrieval": -1.0}, ">= 0"),
    (["continuation", "retrieval"], {"retrieval": float("nan")}, ">= 0"),
    (["continuation", "retrieval"], {"retrieval": 0.0, "continuation": 0.0}, "all 0")])
def test_bad_objectives_and_weights_are_errors(names, weights, match):
    with pytest.raises(ProfileError, match=match):
        ob.parse_objectives(names, weights)


def test_objectives_that_need_a_tokenizer_say_so():
    with pytest.raises(ProfileError, match="tokenizer"):
        ob.build(["retrieval"], _held(), PREFIX)
    with pytest.raises(ProfileError, match="tokenizer"):
        ob.build(["reconstruction"], _held(), PREFIX)


# -- measured tables -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(model, small_settings):
    settings = small_settings(rules=("streamingllm", "h2o"), keeps=(0.25, 1.0), bits=(16, 4), prefix=PREFIX,
                              objectives=("continuation", "reconstruction", "retrieval"), reconstruction_chunk=32,
                              objective_weights={"retrieval": 2.0, "continuation": 0.5})
    result = calibrate(model, _held(2, seed=1), settings, heldout=_held(), tokenizer=Words())
    return settings, result.profile


def test_each_objective_table_equals_an_independent_runtime_measurement(model, measured):
    settings, prof = measured
    geometry = geometry_of_model(model)
    built = ob.build(settings.objectives, _held(), PREFIX, tokenizer=Words(), seed=settings.seed, chunk_tokens=32)
    cols = e2e.kl_columns(prof.configs, "subset")
    assert {prof.configs[c].rule for c in cols} == {"full", "streamingllm", "h2o"}
    for name, items in built.items():
        table = prof.metrics[ob.METRIC_OF[name]]
        for layer in range(geometry.num_layers):
            for col in cols:
                plan = val.config_plan(geometry, layer, prof.configs[col])
                direct = np.mean([val.kl_divergence(val.reference_logprobs(model, it.ids, PREFIX)[1:][list(it.rows)],
                                                    val.plan_logprobs(model, plan, it.ids, PREFIX)[1:][list(it.rows)])
                                  for it in items])
                assert table[layer, col] == pytest.approx(direct, rel=1e-4, abs=1e-7), (name, layer, col)
    assert prof.metrics["kl_reconstruction"].max() > 0 and prof.metrics["kl_retrieval"].max() > 0


def test_the_profile_routes_on_the_weighted_mix_and_round_trips(measured):
    _, prof = measured
    assert prof.routing_metric == prof.default_metric == "kl_mix"
    assert prof.objective_weights == {"kl": 0.5, "kl_reconstruction": 1.0, "kl_retrieval": 2.0}
    np.testing.assert_allclose(prof.table(), 0.5 * prof.metrics["kl"] + prof.metrics["kl_reconstruction"]
                               + 2.0 * prof.metrics["kl_retrieval"], rtol=1e-12)
    again = loads(prof.to_json())
    assert again.objective_weights == prof.objective_weights and again.fingerprint == prof.fingerprint
    assert '"objective_weights": {"kl": 0.5, "kl_reconstruction": 1.0, "kl_retrieval": 2.0}' in prof.to_json()


class Interrupted(Exception):
    pass


def test_an_interrupted_run_with_objectives_resumes_to_the_same_profile(model, measured, tmp_path):
    settings, prof = measured
    folder = str(tmp_path / "x.partial")
    with pytest.raises(Interrupted):
        calibrate(model, _held(2, seed=1), settings, heldout=_held(), tokenizer=Words(), checkpoint_dir=folder,
                  on_layer=lambda layer: (_ for _ in ()).throw(Interrupted()) if layer == 1 else None)
    resumed = []
    again = calibrate(model, _held(2, seed=1), settings, heldout=_held(), tokenizer=Words(), checkpoint_dir=folder,
                      on_layer=resumed.append)
    assert resumed == [2] and again.profile.fingerprint == prof.fingerprint


def test_a_continuation_only_profile_writes_no_objective_fields(model, small_settings):
    settings = small_settings(rules=("streamingllm",), keeps=(0.25, 1.0), bits=(16,), prefix=PREFIX)
    prof = calibrate(model, _held(1, seed=1), settings, heldout=_held(1)).profile
    assert prof.objective_weights is None and prof.routing_metric == "kl" and "objective_weights" not in prof.to_json()
    assert sorted(prof.metrics) == ["kl", "l2"]


def test_objectives_beyond_continuation_need_held_out_sequences(model, small_settings):
    settings = small_settings(rules=("streamingllm",), keeps=(0.25, 1.0), bits=(16,), prefix=PREFIX,
                              objectives=("retrieval",))
    with pytest.raises(ProfileError, match="held-out"):
        calibrate(model, _held(1, seed=1), settings, tokenizer=Words())


# -- disjoint from the studies --------------------------------------------------------------------------------------

def _study_items():
    """Items of every registered task that builds offline (the synthetic ones; file loaders need a path)."""
    registry, out = get_registry(), {}
    for name in registry.names("task"):
        task = registry.task(name)()
        for seed in (0, 1):
            try:
                out.setdefault(name, []).extend(task.make_items(WhitespaceTokenizer(), 2, seed))
            except StudyError:
                out.pop(name, None)
                break
    return out


def _fragments(template: str) -> list[str]:
    """The fixed text of a template between its placeholders, where it is a phrase (three words or more)."""
    return [f.strip() for f in re.split(r"\{[a-z_]+\}", template) if len(f.split()) >= 3]


def _passages(text: str) -> set[str]:
    return {p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80}


def test_retrieval_templates_and_filler_share_nothing_with_any_study_task():
    studies = _study_items()
    assert {"passkey", "niah", "variable_tracking"} <= set(studies)
    study_text = [i.context + "\n\n" + i.question for items in studies.values() for i in items]
    ours = [f for t in ob.TEMPLATES for f in _fragments(t.fact) + _fragments(t.question)]
    assert len(ob.TEMPLATES) >= 4 and ours
    for fragment in ours:
        assert not any(fragment in text for text in study_text), fragment
    # the study templates' fixed text never appears in a calibration fact or question
    import polykv.studies.tasks.niah as niah
    import polykv.studies.tasks.passkey as passkey
    import polykv.studies.tasks.variable_tracking as vt

    theirs = [f for m in (passkey, niah, vt) for k, v in vars(m).items() if k.isupper() and isinstance(v, str)
              for f in _fragments(v)]
    theirs += [f for v in vars(niah).get("DIRECT_QUESTIONS", ()) for f in _fragments(v)]
    our_text = "\n".join(t.fact + "\n" + t.question for t in ob.TEMPLATES)
    assert theirs and not [f for f in theirs if f in our_text]
    # filler: the retrieval haystacks (reserved prose) share no passage with any study item's context, nor with any
    # document of the corpus the study fillers and calibration sequences are drawn from
    study_passages = set().union(*(_passages(t) for t in study_text))
    corpus = _all_corpus_passages()
    for seed in (0, 1):
        haystack = _passages(reserved_text(60_000, seed=seed))
        assert haystack and not haystack & study_passages and not haystack & corpus


def _all_corpus_passages() -> set[str]:
    """Every passage of every corpus document (the pools study fillers and calibration sequences draw from)."""
    return set().union(*(_passages(d.text) for d in _prose_documents() + _code_documents()))
