"""Decode steps attend straight from the stores when the dense view would cost something.

The runtime reads the stores (``polykv.attention.online_softmax.decode_attention_from_stores``, per head for a
ragged layer) in a decode forward of a full-attention layer whose stores read in token blocks, that no
rule state observes every step, and that is quantized (the view would dequantize the whole layer) or
ragged (the view would pad every head to the longest). Its logits equal the dense-view path's (the
blockwise read, ``POLYKV_KIVI_CPU_KERNEL=0``: bit for bit over uniform heads, where both make the same SDPA
call over the same values; the compiled CPU kernel over the codes, and ragged heads: to float32 rounding),
and a store is dequantized (a view built) only when an eviction needs it.
"""

import pytest
import torch

import polykv
from polykv.runtime import storage as storage_module
from polykv.runtime.storage import LayerStorage
from polykv.adapters.quantizers import kivi_cpu
from polykv.adapters.quantizers.kivi_keys import KiviKeyStore
from polykv.adapters.quantizers.kivi_values import KiviValueStore
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.testing import tiny_model
from polykv.runtime.cache import cache_keyword

QP = {"group_size": 8, "residual": 16}
STEPS = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=6, kv_heads=2, head_dim=32, vocab=96)


def _decode(model, plan, ids, *, codes: bool, monkeypatch, registry=None):
    """Prefill then STEPS greedy steps: (logits of every step, whole-store dequantizations during decode)."""
    calls = {"dequantize": 0}
    for cls in (KiviKeyStore, KiviValueStore):
        def counting(self, _orig=cls.dequantize):
            calls["dequantize"] += 1
            return _orig(self)
        monkeypatch.setattr(cls, "dequantize", counting)
    # check=False: these tests count the hot path's dequantizations, which the expensive contract checks add
    with polykv.apply(model, plan, registry=registry, check=False) as session:
        out = session.prefill(ids)
        calls["dequantize"] = 0
        for layer in session.cache.layers:
            layer.read_stores = codes
        calls["ragged"] = [layer.storage.ragged for layer in session.cache.layers]
        # a multi-token forward first (a question after the context): its new tokens attend causally
        more = torch.randint(1, 96, (ids.shape[0], 5), generator=torch.Generator().manual_seed(9))
        out = model(more, **{cache_keyword(model): session.cache}, use_cache=True)
        tok, logits = out.logits[:, -1:].argmax(-1), [out.logits[:, -1], out.logits[:, 0]]
        for _ in range(STEPS):
            out = model(tok, **{cache_keyword(model): session.cache}, use_cache=True)
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
    monkeypatch.undo()
    return torch.stack(logits), calls


def _count_from_codes(monkeypatch):
    """Count decode forwards that took the codes path (``from_codes`` is reset after every forward)."""
    seen = {"n": 0}
    orig = storage_module.decode_attention_from_stores

    def counting(*args, **kwargs):
        seen["n"] += 1
        return orig(*args, **kwargs)
    monkeypatch.setattr(storage_module, "decode_attention_from_stores", counting)
    return seen


@pytest.mark.parametrize("k_bits,v_bits", [(4, 4), (2, 8), (16, 4), (8, 16)])
def test_keep_everything_quantized_decode_reads_codes_only(model, k_bits, v_bits, monkeypatch):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, k_bits=k_bits, v_bits=v_bits, quantizer_params=QP)
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    seen = _count_from_codes(monkeypatch)
    got, calls = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    read = seen["n"]
    seen = _count_from_codes(monkeypatch)
    want, ref_calls = _decode(model, plan, ids, codes=False, monkeypatch=monkeypatch)
    assert read == (STEPS + 1) * geo.num_layers and seen["n"] == 0
    assert calls["dequantize"] == 0 and ref_calls["dequantize"] > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)  # the CPU kernel over the codes: float32 rounding
    # the blockwise read, one block: the same SDPA call (causal among the multi-token forward's queries) over
    # the same dequantized values as the view path, so the same bits
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, "0")
    blockwise, _ = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    assert torch.equal(blockwise, want)


def test_a_bfloat16_model_reads_the_stores_in_its_own_dtype(monkeypatch):
    model = tiny_model("llama", layers=2, heads=6, kv_heads=2, head_dim=32, vocab=96, dtype=torch.bfloat16)
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, k_bits=4, v_bits=4, quantizer_params=QP)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(6))
    got, _ = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    want, _ = _decode(model, plan, ids, codes=False, monkeypatch=monkeypatch)
    # the CPU kernel attends in float32 over the bfloat16 scales and residual: bfloat16 rounding apart
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, "0")  # the blockwise read: SDPA in bfloat16, as the view path
    blockwise, _ = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    assert torch.equal(blockwise, want)


def test_an_evicting_rule_dequantizes_only_when_it_evicts(model, monkeypatch):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="streamingllm", capacity=24), k_bits=4, v_bits=4,
                               quantizer_params=QP, decode_slack=8)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    got, calls = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    want, ref_calls = _decode(model, plan, ids, codes=False, monkeypatch=monkeypatch)
    assert 0 < calls["dequantize"] < ref_calls["dequantize"]    # once per eviction, not every step
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_layer_whose_rule_observes_every_step_reads_its_dequantized_keys(model, monkeypatch):
    """H2O accumulates every decode query's attention over the dequantized keys: no codes path there."""
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="h2o", capacity=24), k_bits=4, v_bits=4,
                               quantizer_params=QP, decode_slack=8)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    seen = _count_from_codes(monkeypatch)
    _, calls = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    assert seen["n"] == 0 and calls["dequantize"] >= STEPS * geo.num_layers


def test_a_sixteen_bit_plan_never_takes_the_codes_path(model, monkeypatch):
    geo = geometry_of_model(model)
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    seen = _count_from_codes(monkeypatch)
    _decode(model, polykv.full_plan(geo), ids, codes=True, monkeypatch=monkeypatch)
    assert seen["n"] == 0


def _count_views(monkeypatch):
    seen = {"n": 0}
    orig = LayerStorage.view

    def counting(self):
        seen["n"] += 1
        return orig(self)
    monkeypatch.setattr(LayerStorage, "view", counting)
    return seen


@pytest.mark.parametrize("bits", [16, 4])
def test_ragged_heads_attend_their_own_stores_without_padding(llama, prompt, bits, monkeypatch):
    """KV heads holding different counts (8 and 16): each head's G query heads attend its own segment."""
    from tests.runtime.v2_plugins import registry_with_plugins

    model, geo = llama
    registry = registry_with_plugins()
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="test-headwise", capacity=12), k_bits=bits, v_bits=bits,
                               quantizer_params={"group_size": 4, "residual": 4})
    ids = prompt(2, 40)
    views = _count_views(monkeypatch)
    got, calls = _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch, registry=registry)
    read_views = views["n"]
    views = _count_views(monkeypatch)
    want, _ = _decode(model, plan, ids, codes=False, monkeypatch=monkeypatch, registry=registry)
    assert all(calls["ragged"])
    assert read_views == 0 and views["n"] >= (STEPS + 1) * geo.num_layers
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_uniform_sixteen_bit_layer_keeps_sdpa_over_its_buffers(model, monkeypatch):
    geo = geometry_of_model(model)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=12))
    ids = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    seen = _count_from_codes(monkeypatch)
    _decode(model, plan, ids, codes=True, monkeypatch=monkeypatch)
    assert seen["n"] == 0
