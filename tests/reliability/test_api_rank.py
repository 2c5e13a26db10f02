"""Bad input to the low-rank axis through the Python API: one clear exception each, before the model runs."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.contract.model_data import ModelDataError
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KV_BASES_KEY, KVBases
from polykv.plan import LayerPlan, OpSpec, uniform_plan
from polykv.testing import tiny_model

D = 16


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=D)
    return m, geometry_of_model(m)


def _bases(fingerprint, layers=2, d=D):
    eye = torch.eye(d).expand(layers, 2, d, d).contiguous()
    energy = torch.linspace(1, 0, d).expand(layers, 2, d).contiguous()
    return KVBases(key=eye, value=eye, key_energy=energy, value_energy=energy, fingerprint=fingerprint)


def _ranked(plan, **ranks):
    return attrs.evolve(plan, layers=[attrs.evolve(lp, **ranks) for lp in plan.layers])


def _refused_before_the_model_runs(m, fn):
    calls = []
    handle = m.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        fn()
    finally:
        handle.remove()
    assert calls == []


def test_a_rank_larger_than_the_head_dim(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo), k_rank=D + 1)
    with pytest.raises(PlanError, match=r"layer 0, field 'layers\[0\]\.k_rank': rank 17 exceeds the model's head dim 16"):
        _refused_before_the_model_runs(m, lambda: polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)}))


def test_a_rank_below_one_is_refused_by_the_record():
    with pytest.raises(PlanError, match=r"layer 3, field 'v_rank': v_rank must be a whole number of channels >= 1"):
        LayerPlan(layer=3, v_rank=0)


def test_a_rank_the_quantizer_group_size_does_not_divide(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params={"group_size": 8, "residual": 8}), v_rank=12)
    with pytest.raises(PlanError, match=r"field 'layers\[0\]\.v_rank': v_rank 12: quantizer 'kivi' quantizes values in "
                                        r"groups of group_size=8 channels"):
        _refused_before_the_model_runs(m, lambda: polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)}))


def test_a_rank_whose_codes_do_not_fill_whole_bytes(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo, k_bits=2, v_bits=4, quantizer_params={"group_size": 8, "residual": 8}), k_rank=5)
    with pytest.raises(PlanError, match=r"field 'layers\[0\]\.k_rank': k_rank 5: 5 channels of 2-bit codes do not fill "
                                        r"whole bytes"):
        polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)})


def test_key_ranks_need_no_group_of_channels(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo, k_bits=2, v_bits=4, quantizer_params={"group_size": 8, "residual": 8}), k_rank=12)
    with torch.no_grad(), polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)}) as s:
        s.prefill(torch.randint(1, 100, (1, 20)))
        assert s.cache.layers[0].key_store.dequantize().shape[-1] == 12


def test_bases_given_for_another_model(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo), k_rank=8)
    with pytest.raises(RuntimeConfigError, match=r"model_data\['kv_bases'\]: key/value bases belong to model "
                                                 r"cfg-000000000000\+s-000000000000, not " + geo.fingerprint.replace("+", r"\+")):
        _refused_before_the_model_runs(m, lambda: polykv.apply(m, plan, model_data={
            KV_BASES_KEY: _bases("cfg-000000000000+s-000000000000")}))


def test_bases_of_another_shape_given(model):
    m, geo = model
    with pytest.raises(RuntimeConfigError, match=r"model_data\['kv_bases'\]: key/value bases are for L=3"):
        polykv.apply(m, _ranked(uniform_plan(geo), v_rank=8), model_data={KV_BASES_KEY: _bases(None, layers=3)})


def test_a_plan_naming_a_bases_file_of_another_model(model, tmp_path):
    m, geo = model
    _bases("cfg-000000000000+s-000000000000").save(tmp_path / "b.kvbases.safetensors")
    plan = attrs.evolve(_ranked(uniform_plan(geo), k_rank=8),
                        model_data={KV_BASES_KEY: str(tmp_path / "b.kvbases.safetensors")})
    with pytest.raises(PlanError, match=r"field 'model_data\.kv_bases': key/value bases belong to model cfg-0000"):
        _refused_before_the_model_runs(m, lambda: polykv.apply(m, plan))


def test_a_damaged_bases_file(model, tmp_path):
    m, geo = model
    (tmp_path / "b.kvbases.safetensors").write_bytes(b"not safetensors")
    plan = attrs.evolve(_ranked(uniform_plan(geo), k_rank=8),
                        model_data={KV_BASES_KEY: str(tmp_path / "b.kvbases.safetensors")})
    with pytest.raises(PlanError, match=r"b\.kvbases\.safetensors: not a readable key/value bases file"):
        polykv.apply(m, plan)


def test_missing_bases_with_refuse_names_the_ranked_layers(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo), v_rank=8).with_layer(0, v_rank=None)
    with pytest.raises(ModelDataError, match=r"key/value bases 'kv_bases' for the ranks of layers 1: not found"):
        polykv.apply(m, plan, missing_model_data="refuse")


@pytest.mark.parametrize("rule", ["triattention", "expected-attention"])
def test_a_rule_that_reads_rope_on_a_layer_of_key_codes(model, rule):
    m, geo = model
    plan = _ranked(uniform_plan(geo, prefill=OpSpec(rule=rule, capacity=8)), k_rank=8)
    with pytest.raises(PlanError, match=rf"layer 0, field 'layers\[0\]\.k_rank': rule '{rule}' reads keys in RoPE "
                                        r"coordinates"):
        polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)})


def test_a_rule_that_reads_rope_is_fine_on_a_layer_of_value_codes_only(model):
    m, geo = model
    plan = _ranked(uniform_plan(geo, prefill=OpSpec(rule="expected-attention", capacity=8)), v_rank=8)
    with torch.no_grad(), polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)}) as s:
        s.prefill(torch.randint(1, 100, (1, 20)))


@pytest.mark.parametrize("member", [0, 1])
def test_a_rank_on_a_layer_of_a_shared_pair(model, member):
    m, geo = model
    plan = uniform_plan(geo).with_layer(1, share=0).with_layer(member, k_rank=8)
    with pytest.raises(PlanError, match=rf"layer {member}, field 'layers\[{member}\]\.k_rank': layer {member} of the "
                                        r"pair 0-1 stores k_rank = 8; a shared pair merges full-width K/V"):
        polykv.apply(m, plan, model_data={KV_BASES_KEY: _bases(geo.fingerprint)})
