"""A plan names the files its rules' per-model data lives in, and ``polykv.apply`` finds the data: the given
``model_data``, the plan's file (checked against the model), the cache, else computed on the offline
corpus (noted, then cached) or refused in one line, as the caller chooses."""

from __future__ import annotations

import json
import os
import warnings

import attrs
import pytest
import torch

import polykv
from polykv.adapters.rules.triattention import STATS_KEY, TriAttentionRule
from polykv.errors import PlanError
from polykv.models.geometry import geometry_of_model
from polykv.contract.hookspecs import hookimpl
from polykv.contract.model_data import ModelDataError, ModelDataNeed, ModelDataNote, cached_file
from polykv.plan import OpSpec, load_plan, uniform_plan, validate_plan
from polykv.adapters.rules.query_stats import QUERY_STATS_SUFFIX, QueryStats, compute_query_stats
from polykv.registry import Registry, get_registry
from polykv.studies.runner import CharTokenizer
from polykv.testing import tiny_model

COMPUTED: list[int] = []


def _counted_stats(model, batches):
    COMPUTED.append(sum(int(b.numel()) for b in batches))
    return compute_query_stats(model, batches)


class CountedTriAttention(TriAttentionRule):
    """TriAttention whose statistics, when computed, are counted (so a test sees whether they were)."""

    name = "counted-triattention"
    model_data_need = ModelDataNeed(key="counted-stats", suffix=QUERY_STATS_SUFFIX, compute=_counted_stats,
                                    load=QueryStats.load, check=lambda stats, model: stats.check_model(model),
                                    description="pre-RoPE query statistics")

    def _stats(self, ctx):
        stats = (ctx.model_data or {}).get("counted-stats")
        if stats is None:
            raise ValueError("rule 'counted-triattention' got no statistics")
        return stats


class Plugin:
    @hookimpl
    def register_operators(self, register):
        register(CountedTriAttention)


@pytest.fixture
def registry():
    reg = Registry(load_entry_points=False)
    reg.register_plugin(Plugin(), name="counted")
    COMPUTED.clear()
    return reg


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _stats_for(model) -> QueryStats:
    g = torch.Generator().manual_seed(0)
    return compute_query_stats(model, [torch.randint(1, 100, (1, 32), generator=g)])


def _plan(model, rule="triattention", model_data=None):
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule=rule, capacity=8))
    return attrs.evolve(plan, model_data=model_data or {})


def _generate(model, plan, **apply_kw):
    ids = torch.randint(1, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), polykv.apply(model, plan, **apply_kw) as session:
        model.generate(ids, max_new_tokens=3, do_sample=False)
        return session


# -- the plan field -------------------------------------------------------------------------------

def test_the_field_is_relative_to_the_plan_file_and_follows_a_save_elsewhere(model, tmp_path):
    data = tmp_path / "profiles" / "m.qstats.safetensors"
    data.parent.mkdir()
    first = tmp_path / "plans" / "p.plan.json"
    first.parent.mkdir()
    _plan(model, model_data={STATS_KEY: str(data)}).save(str(first))
    written = json.loads(first.read_text())
    assert written["model_data"] == {STATS_KEY: "../profiles/m.qstats.safetensors"}
    plan = load_plan(str(first))
    assert plan.model_data == {STATS_KEY: str(data)}               # resolved against the plan's folder
    plan.save(str(first))
    assert json.loads(first.read_text()) == written                 # same folder: the same file
    other = tmp_path / "a" / "b" / "q.plan.json"
    other.parent.mkdir(parents=True)
    plan.save(str(other))
    assert json.loads(other.read_text())["model_data"] == {STATS_KEY: "../../profiles/m.qstats.safetensors"}
    assert load_plan(str(other)).model_data == plan.model_data


def test_plans_without_the_field_load_and_save_as_before(model, tmp_path):
    path = tmp_path / "p.json"
    _plan(model).save(str(path))
    assert "model_data" not in path.read_text()
    assert load_plan(str(path)).model_data == {}


@pytest.mark.parametrize("value, message", [("", "non-empty file path"), (3, "non-empty file path"),
                                            ([], "expected a JSON object")])
def test_a_malformed_field_is_refused_naming_it(model, tmp_path, value, message):
    path = tmp_path / "p.json"
    _plan(model).save(str(path))
    raw = json.loads(path.read_text())
    raw["model_data"] = {STATS_KEY: value} if value != [] else value
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=message) as err:
        load_plan(str(path))
    assert "model_data" in str(err.value) and "\n" not in str(err.value)


def test_a_key_no_rule_of_the_plan_reads_is_refused_at_validation(model):
    plan = _plan(model, rule="h2o", model_data={STATS_KEY: "x.safetensors"})
    with pytest.raises(PlanError, match=r"field 'model_data.triattention': no rule of this plan reads"):
        validate_plan(plan, registry=get_registry())


# -- apply ------------------------------------------------------------------------------------------

def test_apply_loads_the_file_the_plan_names(model, tmp_path, registry):
    stats = _stats_for(model)
    path = tmp_path / "m.qstats.safetensors"
    stats.save(str(path))
    plan = _plan(model, rule="counted-triattention", model_data={"counted-stats": str(path)})
    session = _generate(model, plan, registry=registry, missing_model_data="refuse")
    assert torch.equal(session.model_data["counted-stats"].mu_real, stats.mu_real)
    assert COMPUTED == []


def test_given_data_wins_over_the_plans_file(model, tmp_path, registry):
    stats = _stats_for(model)
    plan = _plan(model, rule="counted-triattention", model_data={"counted-stats": str(tmp_path / "absent")})
    session = _generate(model, plan, registry=registry, model_data={"counted-stats": stats},
                        missing_model_data="refuse")
    assert session.model_data["counted-stats"] is stats


def test_compute_notes_the_cost_caches_and_the_next_apply_reads_the_cache(model, registry):
    plan = _plan(model, rule="counted-triattention")
    tokenizer = CharTokenizer(model.config.vocab_size)
    with pytest.warns(ModelDataNote, match=r"computed pre-RoPE query statistics \('counted-stats'\) over the "
                                           r"offline corpus \(4 texts, \d+ tokens\) in [\d.]+ s, cached at") as notes:
        first = _generate(model, plan, registry=registry, tokenizer=tokenizer)
    assert len(COMPUTED) == 1 and COMPUTED[0] > 0
    assert notes[0].filename == __file__                             # the note points at the caller's line
    cached = cached_file(CountedTriAttention.model_data_need, geometry_of_model(model).fingerprint)
    assert os.path.isfile(cached)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelDataNote)
        second = _generate(model, plan, registry=registry, missing_model_data="refuse")
    assert len(COMPUTED) == 1                                        # read from the cache, not recomputed
    assert torch.equal(second.model_data["counted-stats"].mean_abs, first.model_data["counted-stats"].mean_abs)


def test_plans_whose_rules_need_nothing_ignore_the_choice_and_tokenizer(model):
    _generate(model, _plan(model, rule="h2o"), missing_model_data="refuse")


def test_a_model_saved_with_its_tokenizer_computes_without_one_given(saved_tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_tiny_model(16), attn_implementation="sdpa")
    with pytest.warns(ModelDataNote):
        session = _generate(model, _plan(model))
    assert isinstance(session.model_data[STATS_KEY], QueryStats)


def test_studies_read_the_file_a_plan_names_before_the_profile_or_the_corpus(model, tmp_path, registry):
    from polykv.studies.runner import plan_model_data

    stats = _stats_for(model)
    path = tmp_path / "named.qstats.safetensors"
    stats.save(str(path))
    plan = _plan(model, rule="counted-triattention", model_data={"counted-stats": str(path)})
    got = plan_model_data(model, CharTokenizer(model.config.vocab_size), [plan], str(tmp_path / "none.profile.json"),
                          registry=registry)
    assert torch.equal(got["counted-stats"].mu_imag, stats.mu_imag) and COMPUTED == []
