"""Low-rank layers through the runtime: code-space attention, eviction, quantization, bytes, full rank untouched."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.attention import low_rank as low_rank_module
from polykv.attention.low_rank import LowRank
from polykv.memory import memory_report, predict_resident
from polykv.models.geometry import geometry_of_model
from polykv.models.kv_bases import KV_BASES_KEY, KVBases, compute_kv_bases
from polykv.models.reference import masked_reference_logits, record_run
from polykv.plan import OpSpec, per_layer_plan, uniform_plan
from polykv.attention.kernels import sdpa
from polykv.runtime.cache import cache_keyword
from polykv.testing import decode_soak, tiny_model, token_ids

TOL = 1e-5
QP = {"group_size": 4, "residual": 4}


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    return m, geometry_of_model(m)


@pytest.fixture(scope="module")
def bases(model):
    return compute_kv_bases(model[0], [token_ids(1, 64, seed=1), token_ids(1, 48, seed=2)])


def ranked(plan, k_rank, v_rank, layers=None):
    """``plan`` with ``k_rank``/``v_rank`` on ``layers`` (default: every layer)."""
    chosen = range(plan.num_layers) if layers is None else layers
    return attrs.evolve(plan, layers=[attrs.evolve(lp, k_rank=k_rank, v_rank=v_rank) if lp.layer in chosen else lp
                                      for lp in plan.layers])


def _orthonormal(Hkv, d, r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(Hkv, d, d, generator=g, dtype=torch.float64))[0][:, :, :r]


# -- the math ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q", [1, 5])
def test_code_space_attention_equals_full_attention_in_the_span(q):
    B, H, Hkv, T, d, rk, rv = 2, 6, 2, 30, 16, 6, 10
    P, U = _orthonormal(Hkv, d, rk, 0), _orthonormal(Hkv, d, rv, 1)
    g = torch.Generator().manual_seed(3)
    keys = torch.matmul(torch.randn(B, Hkv, T, rk, generator=g, dtype=torch.float64), P.transpose(-1, -2))
    values = torch.matmul(torch.randn(B, Hkv, T, rv, generator=g, dtype=torch.float64), U.transpose(-1, -2))
    query = torch.randn(B, H, q, d, generator=g, dtype=torch.float64)
    full = sdpa(query, keys, values, d ** -0.5)
    lr = LowRank(P, U)
    c, e = lr.codes(keys, values)
    assert c.shape[-1] == rk and e.shape[-1] == rv
    coded = lr.lift(sdpa(lr.queries(query), c, e, d ** -0.5))
    assert (coded - full).abs().max() < TOL


def test_code_space_attention_equals_reconstruct_then_attend_off_the_span():
    B, H, Hkv, T, d = 1, 4, 2, 25, 16
    lr = LowRank(_orthonormal(Hkv, d, 5, 0), _orthonormal(Hkv, d, 7, 1))
    g = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(B, Hkv, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    query = torch.randn(B, H, 1, d, generator=g, dtype=torch.float64)
    c, e = lr.codes(keys, values)
    coded = lr.lift(sdpa(lr.queries(query), c, e, d ** -0.5))
    rk, rv = lr.reconstruct(keys, values)
    assert (coded - sdpa(query, rk, rv, d ** -0.5)).abs().max() < TOL
    assert (coded - sdpa(query, keys, values, d ** -0.5)).abs().max() > 1e-3  # the rank really drops something


def test_a_full_rank_basis_reproduces_the_full_plan_through_the_runtime(model, bases):
    """Keys and values always lie in the span of the whole basis (r = d): the run equals the keep-everything run."""
    m, geo = model
    ids = token_ids(1, 30)
    with torch.no_grad():
        with polykv.apply(m, uniform_plan(geo)) as s:
            want = m.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with polykv.apply(m, ranked(uniform_plan(geo), 16, 16), model_data={KV_BASES_KEY: bases}) as s:
            got = m.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
            assert s.cache.layers[0].key_store.dequantize().shape[-1] == 16
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max() for a, b in zip(got.logits, want.logits)) < TOL


# -- eviction, quantization ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefill, decode", [("snapkv", "h2o"), ("tova", "tova"), ("key-norm", "keydiff"),
                                             ("streamingllm", "scissorhands"), ("h2o", "full")])
@pytest.mark.parametrize("k_rank, v_rank", [(8, 6), (None, 4), (5, None)])
def test_rank_plus_eviction_equals_the_masked_reconstructed_reference(model, bases, prefill, decode, k_rank, v_rank):
    m, geo = model
    params = {"snapkv": {"window": 4, "kernel_size": 3}, "scissorhands": {"history": 16, "recent": 2}}
    plan = uniform_plan(geo, prefill=OpSpec(rule=prefill, capacity=16, params=params.get(prefill, {})),
                        decode="full" if decode == "full" else OpSpec(rule=decode, capacity=16,
                                                                      params=params.get(decode, {})),
                        decode_slack=2)
    plan = ranked(plan, k_rank, v_rank, layers=[1] if k_rank == 5 else None)
    run = record_run(m, plan, token_ids(1, 40), continuation=token_ids(1, 4, seed=5), steps=6,
                     model_data={KV_BASES_KEY: bases})
    assert sorted(run.low_rank) == ([1] if k_rank == 5 else [0, 1])
    assert (run.logits - masked_reference_logits(m, run)).abs().max() < 1e-4


def test_rank_plus_kivi_codes_r_wide_and_reads_the_stores_as_the_dense_view(model, bases):
    m, geo = model
    plan = ranked(uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=20), decode=OpSpec(rule="key-norm",
                  capacity=20), k_bits=4, v_bits=2, quantizer_params=QP, decode_slack=4), 12, 8)
    ids = token_ids(1, 40)
    logits = {}
    for codes in (True, False):
        with torch.no_grad(), polykv.apply(m, plan, model_data={KV_BASES_KEY: bases}) as s:
            out = s.prefill(ids)
            for layer in s.cache.layers:
                layer.read_stores = codes
            tok, rows = out.logits[:, -1:].argmax(-1), []
            for _ in range(10):
                out = m(tok, use_cache=True, **{cache_keyword(m): s.cache})
                rows.append(out.logits[:, -1])
                tok = out.logits[:, -1:].argmax(-1)
            layer = s.cache.layers[0]
            assert type(layer.key_store).__name__ == "KiviKeyStore"
            assert layer.key_store.dequantize().shape[-1] == 12 and layer.value_store.dequantize().shape[-1] == 8
            logits[codes] = torch.stack(rows)
    assert (logits[True] - logits[False]).abs().max() < 1e-4


def test_rank_plus_kivi_is_the_reconstructed_reference_within_quantization_error(model, bases):
    m, geo = model
    base = uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=20), decode=OpSpec(rule="tova", capacity=20),
                        decode_slack=2)
    run16 = record_run(m, ranked(base, 8, 8), token_ids(1, 40), steps=4, model_data={KV_BASES_KEY: bases})
    ref = masked_reference_logits(m, run16)
    kivi = attrs.evolve(base, layers=[attrs.evolve(lp, k_bits=8, v_bits=8, quantizer_params=QP) for lp in base.layers])
    run8 = record_run(m, ranked(kivi, 8, 8), token_ids(1, 40), steps=4, model_data={KV_BASES_KEY: bases})
    assert (run8.logits[:, :40] - ref[:, :40]).abs().max() < 1e-4   # prefill attends the raw prompt codes
    assert (run8.logits - ref).abs().max() < 0.05                    # 8-bit codes: close, not equal


# -- bytes -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k_rank, v_rank, bits", [(8, 8, 4), (12, None, 2), (None, 4, 16), (6, 10, 16)])
def test_measured_resident_bytes_equal_the_prediction(model, bases, k_rank, v_rank, bits):
    m, geo = model
    qp = QP if bits != 16 else {}
    v_rank = v_rank if bits == 16 or v_rank is None or v_rank % 4 == 0 else 8
    plan = ranked(uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=20), decode=OpSpec(rule="h2o", capacity=20),
                               k_bits=bits, v_bits=bits, quantizer_params=qp, decode_slack=2), k_rank, v_rank)
    with torch.no_grad(), polykv.apply(m, plan, model_data={KV_BASES_KEY: bases}) as s:
        s.prefill(token_ids(1, 40))
        got = s.resident_bytes()
    rows = predict_resident(plan, geo, 40, dtype_bytes=4)
    assert list(got.per_layer) == [r.resident_bytes for r in rows]
    assert [m_["positions"] for m_ in got.metadata_per_layer] == [r.metadata["positions"] for r in rows]
    report = memory_report(plan, geo, 40, dtype_bytes=4)
    assert got.bases == report.bases_bytes == 2 * 2 * 16 * ((k_rank or 0) + (v_rank or 0)) * 4
    full = predict_resident(uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=20),
                                         decode=OpSpec(rule="h2o", capacity=20), k_bits=bits, v_bits=bits,
                                         quantizer_params=qp, decode_slack=2), geo, 40, dtype_bytes=4)
    assert sum(r.resident_bytes for r in rows) < sum(r.resident_bytes for r in full)
    worst, bound, over = decode_soak(m, plan, context_tokens=40, steps=12, model_data={KV_BASES_KEY: bases})
    assert over == [0, 0] and all(w <= b for w, b in zip(worst, bound))


def test_the_memory_table_marks_ranks_and_states_the_bases_apart(model):
    _, geo = model
    table = memory_report(ranked(uniform_plan(geo), 8, None, layers=[0]), geo, 100).format_table()
    assert "16r8" in table and "their key/value bases take 512 B once per model" in table
    assert "bases" not in memory_report(uniform_plan(geo), geo, 100).format_table()


# -- full rank is today's path -----------------------------------------------------------------------------------

def test_a_plan_without_ranks_never_builds_a_basis(model, monkeypatch):
    m, geo = model

    def refuse(*a, **k):
        raise AssertionError("a full-rank plan built a LowRank")
    monkeypatch.setattr(low_rank_module.LowRank, "__init__", refuse)
    plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=20), decode=OpSpec(rule="h2o", capacity=20),
                        k_bits=4, v_bits=4, quantizer_params=QP, decode_slack=2)
    with torch.no_grad(), polykv.apply(m, plan) as s:
        m.generate(token_ids(1, 30), max_new_tokens=4, do_sample=False)
        assert all(layer.low_rank is None and layer.spec.low_rank is None for layer in s.cache.layers)
    assert plan.to_json().startswith('{\n  "schema_version": 1,')


# -- bases as per-model data --------------------------------------------------------------------------------------

def test_bases_are_orthonormal_sorted_and_round_trip(bases, tmp_path, model):
    P = bases.basis("key", 1, 16).double()
    assert (torch.matmul(P.transpose(-1, -2), P) - torch.eye(16, dtype=torch.float64)).abs().max() < 1e-5
    assert bool((bases.key_energy[..., :-1] >= bases.key_energy[..., 1:] - 1e-7).all())
    assert bases.positions == 4096 and bases.fingerprint == model[1].fingerprint
    path = tmp_path / "x.kvbases.safetensors"
    bases.save(path)
    back = KVBases.load(path)
    assert torch.equal(back.key, bases.key) and back.fingerprint == bases.fingerprint and back.positions == 4096


def test_the_key_moments_average_the_model_own_rope_rotations(model):
    """R_o of :func:`rope_rotations` is the model's RoPE step by o positions (the averaging's premise)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from polykv.models.kv_bases import rope_rotations

    m, _ = model
    rot = m.model.rotary_emb
    k = torch.randn(1, 1, 1, 16, dtype=torch.float32)
    x = torch.zeros(1, 1, 16)
    cos0, sin0 = rot(x, torch.tensor([[3]]))
    cos1, sin1 = rot(x, torch.tensor([[3 + 250]]))
    k3, _ = apply_rotary_pos_emb(k, k, cos0, sin0)
    k253, _ = apply_rotary_pos_emb(k, k, cos1, sin1)
    R = rope_rotations(rot.inv_freq, torch.tensor([250]))[0].float()
    assert (torch.matmul(R, k3.reshape(16)) - k253.reshape(16)).abs().max() < 1e-4


def test_the_plan_names_its_bases_file_and_the_runtime_loads_it(model, bases, tmp_path):
    m, geo = model
    bases.save(tmp_path / "m.kvbases.safetensors")
    plan = attrs.evolve(ranked(uniform_plan(geo), 8, 8), model_data={KV_BASES_KEY: str(tmp_path / "m.kvbases.safetensors")})
    plan.save(str(tmp_path / "p.plan.json"))
    loaded = polykv.load_plan(str(tmp_path / "p.plan.json"))
    with torch.no_grad(), polykv.apply(m, loaded, missing_model_data="refuse") as s:
        assert torch.equal(s.model_data[KV_BASES_KEY].key, bases.key)
        s.prefill(token_ids(1, 10))
        assert s.cache.layers[0].key_store.dequantize().shape[-1] == 8


def test_missing_bases_are_computed_from_the_corpus_and_cached(model):
    from polykv.contract.model_data import ModelDataNote, cached_file
    from polykv.plan.bases_need import KV_BASES_NEED

    m, geo = model

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [1 + (ord(c) % 120) for c in text]
    with pytest.warns(ModelDataNote, match=r"key/value bases \('kv_bases'\)"):
        s = polykv.apply(m, ranked(uniform_plan(geo), 4, 4), tokenizer=Tok())
    assert isinstance(s.model_data[KV_BASES_KEY], KVBases)
    cached = cached_file(KV_BASES_NEED, geo.fingerprint)
    assert torch.equal(KVBases.load(cached).key, s.model_data[KV_BASES_KEY].key)
    again = polykv.apply(m, ranked(uniform_plan(geo), 4, 4), missing_model_data="refuse")
    assert torch.equal(again.model_data[KV_BASES_KEY].value, s.model_data[KV_BASES_KEY].value)


def test_a_rank_plan_restored_from_a_shared_prefill_equals_its_own_prefill(model, bases):
    """Plans of other ranks prefill differently (code-space attention): the snapshot keeps them apart."""
    from polykv.runtime.fork import capture_prefill, restore_prefill

    m, geo = model
    base = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=16, params={"window": 4}),
                        decode=OpSpec(rule="tova", capacity=16), decode_slack=2)
    plans = [base, ranked(base, 8, 8), ranked(base, 4, None, layers=[0])]
    ids = token_ids(1, 40)
    given = {KV_BASES_KEY: bases}
    snapshot = capture_prefill(m, ids, plans, model_data=given)
    assert len(snapshot.variants) == 3
    for plan in plans:
        with torch.no_grad(), polykv.apply(m, plan, model_data=given) as s:
            want = s.prefill(ids)
            want_keys = [layer.key_store.dequantize().clone() for layer in s.cache.layers]
            cache = restore_prefill(s, snapshot)
            got_keys = [layer.key_store.dequantize() for layer in cache.layers]
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_keys, want_keys))
            tok = want.logits[:, -1:].argmax(-1)
            out = m(tok, use_cache=True, **{cache_keyword(m): cache})
            s.prefill(ids)
            again = m(tok, use_cache=True, **{cache_keyword(m): s.cache})
            assert (out.logits - again.logits).abs().max() < 1e-5
