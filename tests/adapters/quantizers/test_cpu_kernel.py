"""The compiled CPU decode kernel over KIVI codes equals dequantize-then-attend.

Every width (2/4/8 bits and 16-bit passthrough, keys and values mixed), group sizes that fill a byte run or
cut through one (the value path for groups of fewer channels than a byte holds), residual windows, GQA,
several new queries, reserved (strided) buffers, stores after gathers (explicit key group ids) and ragged
heads whose padding holds nan and huge values. The reference is the blockwise read path, itself tested
bit for bit against the stores' ``dequantize``; through ``polykv.apply`` on a tiny model, decoding with the
kernel gives the logits and tokens of decoding with it switched off.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import polykv
from polykv.adapters.quantizers import kivi_cpu
from polykv.contract import model_data
from polykv.attention.online_softmax import blockwise_attention, decode_attention_from_stores, token_blocks
from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model

BITS = [2, 4, 8, 16]


def _check(query, kv, vv, *, scaling=0.25, atol=2e-5):
    got = kivi_cpu.decode_attention(query, kv, vv, scaling=scaling)
    want = blockwise_attention(query, kv, vv, scaling=scaling, block_size=16)
    assert got.shape == want.shape and got.dtype == query.dtype
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=1e-4)


def _query(B, H, q, d, seed=1):
    return torch.randn(B, H, q, d, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _kernel_built():
    if kivi_cpu.library() is None:
        pytest.fail(f"the CPU decode kernel did not build here: {kivi_cpu._state.get('error')}")


@pytest.mark.parametrize("d", [48, 64, 128])
@pytest.mark.parametrize("k_bits,v_bits,group_size", [(4, 4, 16), (2, 8, 16), (8, 2, 4), (16, 4, 16), (4, 16, 2)])
def test_the_head_dims_compiled_for_themselves_match_any_other(d, k_bits, v_bits, group_size, cases):
    """Head dims 64 and 128 run a copy of the kernel compiled for that dim (constant loop lengths); 48 runs the
    copy for any dim. Each equals the blockwise reference, over a context long enough for several splits."""
    ks, vs = cases.filled_pair(k_bits, v_bits, B=1, Hkv=2, T=700, d=d, group_size=group_size, residual=32)
    for q in (1, 2):
        _check(_query(1, 6, q, d), token_blocks(ks), token_blocks(vs), scaling=d ** -0.5)


@pytest.mark.parametrize("k_bits", BITS)
@pytest.mark.parametrize("v_bits", BITS)
@pytest.mark.parametrize("G,q", [(1, 1), (3, 1), (2, 3)])
def test_kernel_matches_dequantize_then_attend(k_bits, v_bits, G, q, cases):
    for T in (45, 48):  # 48: no key residual left
        ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=2, T=T)
        _check(_query(2, 2 * G, q, 16), token_blocks(ks), token_blocks(vs))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size,residual,d", [(1, 4, 16), (2, 4, 16), (8, 8, 32), (16, 32, 64), (32, 64, 64)])
def test_group_sizes_and_residual_windows(bits, group_size, residual, d, cases):
    """Groups of 1 or 2 channels hold fewer channels than a 2-bit byte: the value path that is not a byte run."""
    ks, vs = cases.filled_pair(bits, bits, B=1, Hkv=3, T=150, d=d, group_size=group_size, residual=residual)
    assert ks.num_quantized and vs.num_quantized
    _check(_query(1, 9, 1, d), token_blocks(ks), token_blocks(vs))


@pytest.mark.parametrize("k_bits,v_bits", [(4, 4), (2, 8), (16, 4), (4, 16)])
def test_long_context_with_splits_and_threads(k_bits, v_bits, cases):
    """Thousands of tokens: every head is cut into splits run on several threads and merged."""
    ks, vs = cases.filled_pair(k_bits, v_bits, B=1, Hkv=3, T=2100, d=64, group_size=32, residual=32)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            _check(_query(1, 9, 1, 64), token_blocks(ks), token_blocks(vs), scaling=0.125)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k_bits,v_bits", [(4, 2), (16, 4), (8, 16)])
def test_values_of_another_width_than_the_keys(k_bits, v_bits):
    """A low-rank layer's value codes are narrower than its key codes: the output has the values' width."""
    from polykv.adapters.quantizers.kivi import KiviQuantizer

    quant = KiviQuantizer(group_size=4, residual=8)
    ks, vs = quant.new_store("key", k_bits, dtype=torch.float32, device="cpu"), \
        quant.new_store("value", v_bits, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(3)
    ks.append(torch.randn(2, 2, 45, 16, generator=g))
    vs.append(torch.randn(2, 2, 45, 8, generator=g))
    got = kivi_cpu.decode_attention(_query(2, 4, 2, 16), token_blocks(ks), token_blocks(vs), scaling=0.25)
    assert got.shape == (2, 4, 2, 8)
    _check(_query(2, 4, 2, 16), token_blocks(ks), token_blocks(vs))


@pytest.mark.parametrize("k_bits,v_bits", [(4, 4), (2, 8), (16, 4)])
def test_reads_reserved_buffers(k_bits, v_bits, cases):
    """The runtime's stores reserve rows past the tokens they hold: codes and scales are strided views."""
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=2, T=45, reserve=90)
    assert vs.buffers["codes"].capacity > vs.num_quantized
    _check(_query(2, 4, 1, 16), token_blocks(ks), token_blocks(vs))


def test_after_gathers_uses_group_ids(cases):
    ks, vs = cases.filled_pair(2, 4, T=45)
    idx = cases.random_index(2, 2, 45, 26, seed=3)
    ks.gather(idx)
    vs.gather(idx)
    ks.append(torch.randn(2, 2, 5, 16))
    vs.append(torch.randn(2, 2, 5, 16))
    assert ks.group_ids is not None
    _check(_query(2, 4, 1, 16, seed=2), token_blocks(ks), token_blocks(vs))


@pytest.mark.parametrize("k_bits,v_bits,q", [(4, 2, 1), (16, 8, 2), (8, 16, 1)])
def test_ragged_heads_never_read_padding(k_bits, v_bits, q, cases):
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=3, T=45)
    kv, vv = token_blocks(ks), token_blocks(vs)
    lengths = torch.tensor([[45, 20, 9], [33, 12, 40]])
    kn, kr = cases.ragged_counts(kv, lengths, seed=1)
    vn, vr = cases.ragged_counts(vv, lengths, seed=2)
    kv, vv = cases.poison(kv, kn, kr), cases.poison(vv, vn, vr)
    query = _query(2, 6, q, 16, seed=4)
    got = kivi_cpu.decode_attention(query, kv, vv, scaling=0.25)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.double(), cases.dense_oracle(query, kv, vv, 0.25), atol=2e-5, rtol=1e-4)


def test_bfloat16_stores_and_query(cases):
    """Scales, minima and residual rows in bfloat16 are read as float32; the output is in the query's dtype."""
    ks, vs = cases.filled_pair(4, 4, T=45, dtype=torch.bfloat16)
    query = _query(2, 4, 1, 16).bfloat16()
    _check(query, token_blocks(ks), token_blocks(vs), atol=2e-2)


def test_decode_reads_stores_through_the_kernel_on_cpu(cases, monkeypatch):
    """The runtime's decode call takes the kernel for a CPU query, and the blockwise path when it is off."""
    ks, vs = cases.filled_pair(4, 2, T=45)
    calls = []
    real = kivi_cpu.decode_attention
    monkeypatch.setattr(kivi_cpu, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    query = _query(2, 4, 1, 16)
    fused = decode_attention_from_stores(query, ks, vs, scaling=0.25)
    assert calls == [1]
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, "0")
    blockwise = decode_attention_from_stores(query, ks, vs, scaling=0.25)
    assert calls == [1]
    torch.testing.assert_close(fused, blockwise, atol=2e-5, rtol=1e-4)


def _decode(model, plan, prompt, steps):
    """Greedy tokens and every step's logits of ``steps`` one-token forwards after the prompt."""
    tokens, logits = [], []
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(prompt)
        kw = {session.cache_keyword: session.cache}
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
            out = model(tok, use_cache=True, **kw)
            logits.append(out.logits[:, -1].clone())
    return tokens, torch.cat(logits)


@pytest.mark.parametrize("k_bits,v_bits,evict", [(4, 4, False), (2, 8, False), (4, 4, True), (16, 4, False)])
def test_apply_decodes_the_same_tokens_with_the_kernel(k_bits, v_bits, evict, monkeypatch):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32, vocab=128, seed=0)
    geo = geometry_of_model(model)
    kw = {"prefill": polykv.OpSpec(rule="streamingllm", capacity=40), "decode_slack": 8} if evict else {}
    plan = polykv.uniform_plan(geo, k_bits=k_bits, v_bits=v_bits, quantizer_params={"group_size": 8, "residual": 16},
                               **kw)
    prompt = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    calls = []
    real = kivi_cpu.decode_attention
    monkeypatch.setattr(kivi_cpu, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = _decode(model, plan, prompt, 12)
    assert len(calls) >= 12 * geo.num_layers  # every decode step of every layer read the codes in the kernel
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, "0")
    blockwise = _decode(model, plan, prompt, 12)
    assert len(calls) >= 12 * geo.num_layers and fused[0] == blockwise[0]
    torch.testing.assert_close(fused[1], blockwise[1], atol=1e-4, rtol=1e-4)


def test_unbuildable_kernel_says_so_once_and_decode_reads_blockwise(tmp_path, monkeypatch, cases):
    monkeypatch.setattr(kivi_cpu, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    ks, vs = cases.filled_pair(4, 4, T=45)
    query = _query(2, 4, 1, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = decode_attention_from_stores(query, ks, vs, scaling=0.25)
        again = decode_attention_from_stores(query, ks, vs, scaling=0.25)
    notes = [w for w in seen if issubclass(w.category, kivi_cpu.KernelUnavailableWarning)]
    assert len(notes) == 1 and "\n" not in str(notes[0].message) and "no-such-cc" in str(notes[0].message)
    assert kivi_cpu.ENV_SWITCH in str(notes[0].message)
    want = blockwise_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.25)
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.slow  # runs the C compiler
def test_build_is_cached_by_source_flags_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(kivi_cpu, "_state", {})
    monkeypatch.setattr(model_data, "cache_dir", lambda: str(tmp_path / "model-data"))
    lib = kivi_cpu.library()
    assert lib is not None
    built = list((tmp_path / "kernels").iterdir())
    assert built == [Path(lib._name)] and built[0].name.startswith("kivi_cpu-")
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kivi_cpu, "_state", {})
    assert kivi_cpu.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.slow  # starts a Python process
def test_nothing_is_compiled_at_import(tmp_path):
    code = ("import os, polykv, polykv.adapters.quantizers.kivi_cpu as k; "
            "assert not k._state; assert not os.path.exists(os.path.join(os.environ['POLYKV_CACHE'], 'kernels'))")
    env = {"POLYKV_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("heads,tokens,threads,items", [(3, 8000, 2, 12), (3, 8000, 1, 6), (8, 8000, 2, 8),
                                                        (3, 100, 2, 3), (3, 8000, 16, 96)])
def test_splits_give_every_thread_as_many_items(heads, tokens, threads, items):
    """Four items a thread at least, a whole number each where splits stay over MIN_SPLIT tokens (a short context
    cannot be cut finer: 100 tokens are one split a head)."""
    assert heads * kivi_cpu._splits(heads, tokens, threads) == items


def test_kernel_on_several_threads_matches_one(cases):
    ks, vs = cases.filled_pair(4, 4, B=1, Hkv=3, T=3000, d=64, group_size=32, residual=32)
    query = _query(1, 9, 1, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kivi_cpu.decode_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.125)
        torch.set_num_threads(3)
        three = kivi_cpu.decode_attention(query, token_blocks(ks), token_blocks(vs), scaling=0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(three, one, atol=2e-6, rtol=1e-5)
