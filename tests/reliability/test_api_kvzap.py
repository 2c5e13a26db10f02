"""Bad input to KVzap (rule and allocator ``kvzap``, its surrogate file and its training) through the Python API:
one clear line each, in polykv's own error classes, before anything is kept or written."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from safetensors.torch import save_file

import polykv
from polykv.adapters.rules.kvzap import KVzapRule
from polykv.adapters.rules.kvzap_model import FORMAT, FORMAT_VERSION, KVzapSurrogate
from polykv.adapters.rules.kvzap_train import train_kvzap
from polykv.contract.model_data import ModelDataError
from polykv.contract.params import ParamError
from polykv.errors import PolykvError, ProfileError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec
from polykv.runtime.session import run_probe
from polykv.testing import tiny_model, token_ids
from tests.adapters.rules.test_kvzap import Tok, random_surrogate

FOREIGN = "cfg-000000000000+s-000000000000"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _plan(model, **op):
    return polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="kvzap", **op), decode="full")


def _one_line(err, *parts):
    msg = str(err.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_threshold_that_is_no_finite_number_is_refused(value):
    with pytest.raises(ParamError) as err:
        KVzapRule(threshold=value)
    _one_line(err, "threshold", "finite")


@pytest.mark.parametrize("surrogate,parts", [
    (dict(L=2, Hkv=2, D=64, fingerprint=FOREIGN), [FOREIGN, "polykv model-data"]),     # another model's
    (dict(L=2, Hkv=2, D=32), ["hidden size 32", "hidden size 64"]),                        # another hidden size
    (dict(L=2, Hkv=1, D=64), ["x 1 KV heads", "x 2"]),                                      # another KV head count
    (dict(L=1, Hkv=2, D=64), ["1 layers", "has 2 of"]),                                     # too few layers
])
def test_a_surrogate_of_another_model_is_refused_by_apply(model, forwards, surrogate, parts):
    with pytest.raises(PolykvError) as err:
        polykv.apply(model, _plan(model, capacity=16), model_data={"kvzap": random_surrogate(**surrogate)})
    _one_line(err, *parts)
    assert forwards == []


def test_data_that_is_no_surrogate_is_refused_by_apply(model, forwards):
    with pytest.raises(RuntimeConfigError) as err:
        polykv.apply(model, _plan(model, capacity=16), model_data={"kvzap": "x.kvzap.safetensors"})
    _one_line(err, "model_data['kvzap']", "str")
    assert forwards == []


def test_a_missing_surrogate_is_refused_when_asked_not_to_train_one(model, forwards):
    with pytest.raises(ModelDataError) as err:
        polykv.apply(model, _plan(model, capacity=16), missing_model_data="refuse")
    _one_line(err, "'kvzap'", "not found")
    assert forwards == []


@pytest.mark.parametrize("op,parts", [
    (dict(capacity=8, params={"n_sink": 4, "window": 4}), ["layers[0].prefill", "window"]),
    (dict(capacity=64, params={"threshold": -4.0}), ["layers[0].prefill", "128"]),       # the paper's window
])
def test_protected_tokens_that_fill_the_capacity_are_refused_by_validation(model, op, parts):
    with pytest.raises(PolykvError) as err:
        polykv.apply(model, _plan(model, **op), model_data={"kvzap": random_surrogate(L=2, Hkv=2, D=64)})
    _one_line(err, *parts)


def test_protected_tokens_that_fill_a_ratios_capacity_are_refused_before_any_layer_keeps(model):
    plan = _plan(model, capacity_ratio=0.1, params={"window": 8})
    with polykv.apply(model, plan, model_data={"kvzap": random_surrogate(L=2, Hkv=2, D=64)}) as session:
        with pytest.raises(RuntimeConfigError) as err:
            session.prefill(token_ids(1, 64))
    _one_line(err, "layer 0 (prefill)", "window", "capacity_ratio 0.1 of 64 tokens")


def test_the_allocator_over_layers_of_another_rule_is_refused_in_polykvs_class(model):
    plan = polykv.uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="snapkv", capacity=16), decode="full")
    plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="kvzap", layers=(0, 1)),))
    with polykv.apply(model, plan) as session:
        with pytest.raises(RuntimeConfigError) as err:
            session.prefill(token_ids(1, 64))
    _one_line(err, "layer 0", "allocator 'kvzap'", "prefill rule")


def test_a_batch_of_two_rows_under_the_allocator_is_refused(model):
    plan = attrs.evolve(_plan(model, capacity=16), allocation=(AllocationGroup(allocator="kvzap", layers=(0, 1)),))
    with polykv.apply(model, plan, model_data={"kvzap": random_surrogate(L=2, Hkv=2, D=64)}) as session:
        with pytest.raises(RuntimeConfigError) as err:
            session.prefill(token_ids(2, 64))
    _one_line(err, "allocator 'kvzap'", "batch of 2 rows")


@pytest.mark.parametrize("batches,kwargs,parts", [
    ([], {}, ["at least one text"]),
    ([token_ids(1, 3)], {}, ["text 0", "3 tokens"]),
    ([token_ids(2, 30)], {}, ["text 0", "[2, 30]", "one text per batch"]),             # two rows joined: refused
    ([token_ids(1, 30)], {"positions": 0}, ["positions", ">= 1"]),
    ([token_ids(1, 30)], {"epochs": -1}, ["epochs", ">= 0"]),
    ([token_ids(1, 30)], {"hidden": 0}, ["hidden", ">= 1"]),
    ([token_ids(1, 30)], {"batch_size": 2.5}, ["batch_size"]),
    ([token_ids(1, 30)], {"tokenizer": None}, ["tokenizer"]),
])
def test_bad_training_input_is_refused_before_the_model_runs(model, forwards, batches, kwargs, parts):
    kwargs = {"tokenizer": Tok(), **kwargs}
    with pytest.raises(ModelDataError) as err:
        train_kvzap(model, batches, run_probe=run_probe, **kwargs)
    _one_line(err, *parts)
    assert forwards == []


def _file(tmp_path, version=FORMAT_VERSION, **tensors):
    s = random_surrogate(L=2, Hkv=2, D=16)
    arrays = {n: getattr(s, n) for n in ("feat_mean", "feat_std", "lin_w", "lin_b", "mlp_w1", "mlp_b1", "mlp_w2",
                                         "mlp_b2")}
    path = tmp_path / "s.kvzap.safetensors"
    save_file({**arrays, **tensors}, str(path), metadata={"format": FORMAT, "format_version": str(version)})
    return str(path)


TRAIN = "polykv model-data"


@pytest.mark.parametrize("make,parts", [
    (lambda p: _file(p, mlp_b2=torch.zeros(3, 2)), ["'mlp_b2'", "(3, 2)", "(2, 2)", TRAIN]),
    (lambda p: _file(p, feat_std=torch.zeros(2, 16)), ["'feat_std'", "<= 0", TRAIN]),
    (lambda p: _file(p, lin_w=torch.full((2, 16, 2), math.nan)), ["lin_w", TRAIN]),
    (lambda p: _file(p, mlp_w1=torch.zeros(2, 2, 16, 5)), ["'mlp_w1'", "[L, D, h]", TRAIN]),     # the old layout
    (lambda p: _file(p, version=1), ["version 1", "stored keys and values", "retrain it with `polykv model-data"]),
    (lambda p: _file(p, version=3), ["version '3'", TRAIN]),
    (lambda p: (p / "junk.kvzap.safetensors").write_bytes(b"junk") and str(p / "junk.kvzap.safetensors"),
     ["junk.kvzap.safetensors", "not a readable", TRAIN]),
    (lambda p: str(p / "absent.kvzap.safetensors"), ["absent.kvzap.safetensors", TRAIN]),
    (lambda p: str(p), ["not a regular file", "name a kvzap surrogate file"]),
])
def test_a_damaged_surrogate_file_is_refused_in_one_line(tmp_path, make, parts):
    path = make(tmp_path)
    with pytest.raises(ProfileError) as err:
        KVzapSurrogate.load(path)
    _one_line(err, *parts)
