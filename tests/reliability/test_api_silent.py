"""Inputs that cannot be right, through the Python API: KVzip's token ids and sinks, numpy numbers in a plan, a
tokenizer given by name, refine's held-out context, repeated ``--param`` keys. Each is one clear polykv error
before the model runs; and KVzip plans that leave their prompt ids unset build them from the tokenizer."""

from __future__ import annotations

import math
import os

import attrs
import numpy as np
import pytest
import torch

import polykv
from polykv.adapters.rules.kvzip import prompt_params
from polykv.commands.solve import parse_params
from polykv.errors import PlanError, PolykvError, RuntimeConfigError, SolverError
from polykv.models.geometry import geometry_of_model
from polykv.plan import LayerPlan, OpSpec, validate_plan
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, moend_configs
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn
from polykv.testing import tiny_model, token_ids

IDS = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10, 11]}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=256)


def _kvzip(model, capacity=None, ratio=None, **params):
    op = OpSpec(rule="kvzip", capacity=capacity, capacity_ratio=ratio, params=params)
    return polykv.uniform_plan(geometry_of_model(model), prefill=op, decode="full")


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, PolykvError)
    return msg


# -- token-id lists ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(IDS))
@pytest.mark.parametrize("value", [[], [3, -1], [3, 1.0], [True], [1 << 40]], ids=["empty", "negative", "float",
                                                                                   "bool", "past-int32"])
def test_a_bad_token_id_list_is_refused_by_apply_naming_layer_and_parameter(model, forwards, name, value):
    if name == "suffix_ids" and value == []:
        polykv.apply(model, _kvzip(model, capacity=8, **dict(IDS, suffix_ids=[])))   # no header: a valid prompt
        return
    with pytest.raises(PlanError) as err:
        polykv.apply(model, _kvzip(model, capacity=8, **dict(IDS, **{name: value})))
    msg = _one_line(err)
    assert "layer 0" in msg and f"layers[0].prefill.params.{name}" in msg
    assert forwards == []


@pytest.mark.parametrize("name", sorted(IDS))
def test_token_ids_past_the_models_vocabulary_are_refused_by_apply(model, forwards, name):
    vocab = model.config.vocab_size
    with pytest.raises(PlanError) as err:
        polykv.apply(model, _kvzip(model, capacity=8, **dict(IDS, **{name: [3, vocab]})))
    msg = _one_line(err)
    assert f"layers[0].prefill.params.{name}" in msg and f"[0, {vocab})" in msg and str(vocab) in msg
    assert forwards == []


# -- sinks the capacity cannot hold ----------------------------------------------------------------------------
def test_a_prefix_sink_larger_than_the_capacity_is_refused_by_apply(model, forwards):
    with pytest.raises(PlanError) as err:
        polykv.apply(model, _kvzip(model, capacity=16, sink="prefix", prefix_tokens=20, **IDS))
    msg = _one_line(err)
    assert "layers[0].prefill.params.prefix_tokens" in msg and "20" in msg and "16" in msg
    assert forwards == []


def test_a_prefix_sink_larger_than_a_ratio_capacity_is_refused_when_it_resolves(model):
    plan = _kvzip(model, ratio=0.25, sink="prefix", prefix_tokens=20, **IDS)       # 64 tokens -> capacity 16
    with polykv.apply(model, plan) as session, pytest.raises(RuntimeConfigError) as err:
        session.prefill(token_ids(1, 64))
    msg = _one_line(err)
    assert "layer 0 (prefill)" in msg and "'prefix_tokens' is 20" in msg and "capacity is 16" in msg
    assert "capacity_ratio 0.25 of 64 tokens" in msg


@pytest.mark.parametrize("params,param", [({"n_sink": 9}, "n_sink"),
                                          ({"sink": "prefix", "prefix_tokens": 9}, "prefix_tokens")])
def test_kvzip_head_sinks_larger_than_the_capacity_are_refused(model, params, param):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzip-head", capacity=8, params=params),
                               decode="full")
    with pytest.raises(PlanError) as err:
        validate_plan(plan, registry=polykv.get_registry())
    msg = _one_line(err)
    assert f"layers[0].prefill.params.{param}" in msg and "9" in msg and "8" in msg


def test_a_sink_within_the_capacity_still_runs(model):
    plan = _kvzip(model, capacity=16, sink="prefix", prefix_tokens=16, **IDS)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(token_ids(1, 64))
        assert session.cache.layers[0].storage.uniform_count() == 16


# -- numpy numbers in a plan built in Python -------------------------------------------------------------------
def test_numpy_scalars_are_saved_like_python_numbers(model, tmp_path):
    geo = geometry_of_model(model)
    plain = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=64, params={"window": 8}),
                                decode=OpSpec(rule="h2o", capacity_ratio=0.5), k_bits=8, v_bits=4, decode_slack=16)
    numpy = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=np.int64(64),
                                                    params={"window": np.int32(8)}),
                                decode=OpSpec(rule="h2o", capacity_ratio=np.float64(0.5)), k_bits=np.int32(8),
                                v_bits=np.int64(4), decode_slack=np.int16(16))
    plain.save(str(tmp_path / "a.json"))
    numpy.save(str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    assert numpy == plain and type(numpy.layers[0].k_bits) is int and type(numpy.layers[0].prefill.capacity) is int


@pytest.mark.parametrize("build,field", [
    (lambda: OpSpec(rule="snapkv", capacity=np.array([64, 32])), "capacity"),
    (lambda: OpSpec(rule="snapkv", capacity_ratio=np.array(0.5)), "capacity_ratio"),
    (lambda: LayerPlan(layer=0, k_bits=np.array([8])), "k_bits"),
    (lambda: OpSpec(rule="snapkv", capacity=8, params={"window": np.arange(3)}), "params.window"),
    (lambda: OpSpec(rule="snapkv", capacity=8, params={"window": torch.tensor(8)}), "params.window"),
])
def test_arrays_and_other_objects_in_a_plan_are_refused_naming_the_field(build, field):
    with pytest.raises(PlanError) as err:
        build()
    msg = _one_line(err)
    assert field in msg and "a plain number" in msg


def test_an_object_the_plan_file_cannot_hold_is_refused_at_save_not_a_json_traceback(model, tmp_path):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", capacity=8, params={"window": {1, 2}})
    with pytest.raises(PlanError) as err:
        plan.save(str(tmp_path / "p.json"))
    assert "layers[0].prefill.params.window" in _one_line(err)
    assert not os.listdir(tmp_path)


# -- apply(tokenizer=...) takes a tokenizer object -----------------------------------------------------------------
@pytest.mark.parametrize("tokenizer", ["gpt2", b"gpt2", 42, object()], ids=["str", "bytes", "int", "object"])
def test_a_tokenizer_that_is_not_one_is_refused(model, forwards, tokenizer):
    with pytest.raises(RuntimeConfigError) as err:
        polykv.apply(model, _kvzip(model, capacity=8), tokenizer=tokenizer)
    assert "apply(tokenizer=...) expects a tokenizer object" in _one_line(err)
    assert forwards == []


def test_kvzip_without_ids_and_without_a_tokenizer_says_to_pass_one(model, forwards):
    with pytest.raises(RuntimeConfigError) as err:
        polykv.apply(model, _kvzip(model, capacity=8))
    msg = _one_line(err)
    assert "layer 0 (prefill): rule 'kvzip'" in msg and "tokenizer=tok" in msg and "repeat_ids" in msg
    assert forwards == []


# -- KVzip plans build their prompt ids from the tokenizer ----------------------------------------------------------
def _generate(model, plan, ids, **kw):
    with torch.no_grad(), polykv.apply(model, plan, **kw):
        return model.generate(ids, max_new_tokens=4, do_sample=False)


def test_kvzip_ids_come_from_the_tokenizer_given_or_saved_beside_the_model(saved_tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = saved_tiny_model(16)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(folder)
    geo = geometry_of_model(model)
    ids = torch.tensor([tok.encode("The river ran past the mill and the old stone bridge. " * 4)])
    plan = polykv.uniform_plan(geo, prefill="kvzip", capacity_ratio=0.25)
    copied = polykv.uniform_plan(geo, prefill=OpSpec(rule="kvzip", capacity_ratio=0.25, params=prompt_params(tok)))
    want = _generate(model, copied, ids)
    assert torch.equal(_generate(model, plan, ids, tokenizer=tok), want)
    assert torch.equal(_generate(model, plan, ids), want)                     # the tokenizer saved beside the model
    with polykv.apply(model, plan, tokenizer=tok) as session:
        assert session.plan.layers[1].prefill.params == dict(prompt_params(tok))
    assert plan.layers[0].prefill.params == {}                                # the caller's plan is not changed


@pytest.mark.model
def test_kvzip_uniform_plan_runs_on_the_default_model_with_its_tokenizer(default_model, default_geometry):
    model, tok = default_model
    plan = polykv.uniform_plan(default_geometry, prefill="kvzip", capacity_ratio=0.125)
    ids = torch.tensor([tok.encode("Paris is the capital of France. Berlin is the capital of Germany. " * 6)])
    with torch.no_grad(), polykv.apply(model, plan, tokenizer=tok) as session:
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        stored = session.cache.layers[0].storage.uniform_count()
    assert out.shape[1] == ids.shape[1] + 4
    assert stored <= math.ceil(ids.shape[1] * 0.125) + 4                     # the prompt compressed, then decode


# -- refine's held-out context and the --param options -------------------------------------------------------------
class _Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % 120 + 1 for b in text.encode()]}


def _profile(model):
    configs = moend_configs("snapkv", "prefill", keeps=(0.25, 0.5), k_bits=(16,), v_bits=(16,))
    return Profile.from_table(np.random.default_rng(0).random((2, len(configs))), configs, geometry_of_model(model))


@pytest.mark.parametrize("params,names", [({"tokens": 300}, ["tokens=300", "--tokens", "256"]),
                                          ({"tokens": 200, "follow_up": 100}, ["follow_up=100", "256"])])
def test_refine_refuses_a_held_out_context_past_the_models_positions(params, names):
    model = tiny_model(layers=2, head_dim=32, max_position_embeddings=256)
    with pytest.raises(SolverError) as err:
        solve(_profile(model), Budget.parse("2x", 64), "refine", model=MeasureOn(model=model, tokenizer=_Tok()),
              **params)
    msg = _one_line(err)
    assert all(n in msg for n in names) and "max_position_embeddings" in msg


@pytest.mark.parametrize("param", ["sequences", "validate"])
def test_refine_asking_for_more_sequences_than_the_corpus_holds_names_the_option(param):
    model = tiny_model(layers=2, head_dim=32)
    with pytest.raises(SolverError) as err:
        solve(_profile(model), Budget.parse("2x", 64), "refine", model=MeasureOn(model=model, tokenizer=_Tok()),
              tokens=64, **{param: 100000})
    msg = _one_line(err)
    assert f"{param}=" in msg and "min_chars" not in msg and " n " not in msg


@pytest.mark.parametrize("items", [["a=1", "a=2"], ["a=1", "b=2", "a=1"]])
def test_a_repeated_param_key_is_refused(items):
    with pytest.raises(SolverError, match=r"--param a=.*given twice"):
        parse_params(items)


def test_plan_attrs_evolve_with_numpy_also_normalises(model):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill="snapkv", capacity=8)
    lp = attrs.evolve(plan.layers[0], v_bits=np.int8(4))
    assert type(lp.v_bits) is int and lp.v_bits == 4
