"""A rule declares the per-model data it needs; calibration, studies and model_data_for ask the registry.

The rule below is a plugin the core has never heard of: if calibration or the study runner named rules
instead of asking for their declared needs, its data would never reach it.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from polykv.adapters.rules.key_norm import KeyNormRule
from polykv.contract.hookspecs import hookimpl
from polykv.contract.model_data import ModelDataNeed, load_side_files, needs_of_rules, registered_needs, side_file
from polykv.plan import OpSpec, uniform_plan
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import model_data_for, query_stats_path
from polykv.adapters.rules.query_stats import QUERY_STATS_SUFFIX, QueryStats
from polykv.registry import Registry, get_registry

KEY = "token-count"
COMPUTED: list[int] = []


@attrs.define
class TokenCount:
    tokens: int

    def save(self, path):
        with open(path, "w") as fh:
            json.dump({"tokens": self.tokens}, fh)

    @classmethod
    def load(cls, path):
        with open(path) as fh:
            return cls(json.load(fh)["tokens"])


def _count_tokens(model, token_batches):
    total = sum(int(torch.as_tensor(b).numel()) for b in token_batches)
    COMPUTED.append(total)
    return TokenCount(total)


class CountedKeyNorm(KeyNormRule):
    """Key-norm that refuses to run without its model data (so a missing hand-over fails loudly)."""

    name = "counted-key-norm"
    model_data_need = ModelDataNeed(key=KEY, suffix=".tokens.json", compute=_count_tokens, load=TokenCount.load,
                                    description="tokens seen")
    seen: list[int] = []

    def score(self, ctx):
        data = (ctx.model_data or {}).get(KEY)
        if not isinstance(data, TokenCount):
            raise ValueError(f"rule 'counted-key-norm' needs model_data[{KEY!r}]")
        CountedKeyNorm.seen.append(data.tokens)
        return super().score(ctx)


class Plugin:
    @hookimpl
    def register_operators(self, register):
        register(CountedKeyNorm)


@pytest.fixture
def registry():
    reg = Registry(load_entry_points=False)
    reg.register_plugin(Plugin(), name="counted")
    COMPUTED.clear()
    CountedKeyNorm.seen.clear()
    return reg


def test_needs_come_from_the_rules_declarations(registry):
    assert [n.key for n in needs_of_rules(registry, ["h2o", "counted-key-norm", "tova"])] == [KEY]
    assert needs_of_rules(registry, ["h2o", "tova", "no-such-rule"]) == []
    keys = {n.key: n for n in registered_needs(registry)}
    # the built-in query statistics keep their key and their side file, so shipped profiles still load
    assert keys["triattention"].suffix == QUERY_STATS_SUFFIX == ".qstats.safetensors"
    assert side_file("a/x.profile.json", ".tokens.json") == "a/x.tokens.json"
    assert query_stats_path("a/x.profile.json") == "a/x.qstats.safetensors"


def test_a_need_must_be_declared_with_the_right_type(registry):
    class Broken(KeyNormRule):
        name = "broken-need"
        model_data_need = {"key": "x"}

    class BrokenPlugin:
        @hookimpl
        def register_operators(self, register):
            register(Broken)

    registry.register_plugin(BrokenPlugin(), name="broken")
    with pytest.raises(TypeError, match="ModelDataNeed"):
        needs_of_rules(registry, ["broken-need"])


def test_calibration_computes_declared_data_hands_it_to_the_rule_and_saves_it(model, sequences, small_settings,
                                                                             registry, tmp_path):
    seqs = sequences(2)
    result = calibrate(model, seqs, small_settings(rules=("counted-key-norm", "h2o")), registry=registry)
    assert COMPUTED == [sum(s.numel() for s in seqs)]              # once, over the calibration sequences
    assert result.model_data == {KEY: TokenCount(COMPUTED[0])}
    assert CountedKeyNorm.seen and set(CountedKeyNorm.seen) == {COMPUTED[0]}
    assert result.query_stats is None                               # no calibrated rule needs query statistics
    profile = str(tmp_path / "m.profile.json")
    files = result.side_files(profile)
    assert list(files) == [str(tmp_path / "m.tokens.json")]
    for path, data in files.items():
        data.save(path)
    assert model_data_for(profile, registry=registry) == {KEY: TokenCount(COMPUTED[0])}
    assert load_side_files(profile, needs_of_rules(registry, ["h2o"])) == {}


def test_calibration_without_such_rules_computes_nothing(model, sequences, small_settings, registry):
    result = calibrate(model, sequences(2), small_settings(rules=("h2o",)), registry=registry)
    assert result.model_data == {} and result.side_files("x.profile.json") == {} and COMPUTED == []


def test_triattention_calibration_still_yields_query_statistics(model, sequences, small_settings, tmp_path):
    result = calibrate(model, sequences(2), small_settings(rules=("triattention",)), registry=get_registry())
    assert isinstance(result.query_stats, QueryStats)
    assert result.model_data == {"triattention": result.query_stats}
    other = str(tmp_path / "elsewhere.safetensors")
    assert result.side_files("p.profile.json") == {"p.qstats.safetensors": result.query_stats}
    assert result.side_files("p.profile.json", query_stats_path=other) == {other: result.query_stats}


def test_study_runner_loads_the_side_file_or_computes_the_data(model, registry, tmp_path):
    from polykv.models.geometry import geometry_of_model
    from polykv.studies.runner import CharTokenizer, plan_model_data

    geo = geometry_of_model(model)
    plan = uniform_plan(geo, prefill=OpSpec(rule="counted-key-norm", capacity=8))
    tokenizer = CharTokenizer(model.config.vocab_size)
    computed = plan_model_data(model, tokenizer, [plan], None, registry=registry)
    assert list(computed) == [KEY] and COMPUTED == [computed[KEY].tokens] and COMPUTED[0] > 0
    profile = str(tmp_path / "m.profile.json")
    TokenCount(7).save(side_file(profile, ".tokens.json"))
    assert plan_model_data(model, tokenizer, [plan], profile, registry=registry) == {KEY: TokenCount(7)}
    assert len(COMPUTED) == 1                                       # read, not recomputed
    assert plan_model_data(model, tokenizer, [uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=8))], profile,
                           registry=registry) == {}
