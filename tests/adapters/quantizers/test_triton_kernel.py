"""The Triton decode kernel equals the blockwise reference, run on CPU in Triton's interpreter.

``TRITON_INTERPRET=1`` is set before the kernel module is imported (Triton decides at decoration
time); on a CUDA machine the same cases also run on the GPU. Sizes stay small: the interpreter
executes every program in numpy.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from polykv.attention.online_softmax import blockwise_attention, token_blocks  # noqa: E402

pytest.importorskip("triton")  # the 'kernels' extra, which scripts/setup.sh installs
from polykv.adapters.quantizers import kivi_triton  # noqa: E402

pytestmark = pytest.mark.slow  # the kernel runs in Triton's CPU interpreter

DEVICES = (["cpu"] if kivi_triton.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


def test_kernel_runs_somewhere():
    """On CPU the kernel must have been built for the interpreter (or a GPU must be present)."""
    assert DEVICES, "TRITON_INTERPRET was not set before Triton kernels were built and there is no GPU"


def _check(query, kv, vv, *, scaling=0.25, splits=None, atol=2e-5):
    got = kivi_triton.decode_attention(query, kv, vv, scaling=scaling, splits=splits)
    want = blockwise_attention(query, kv, vv, scaling=scaling, block_size=16)
    assert got.shape == want.shape and got.dtype == query.dtype
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_bits,v_bits,G,q", [(2, 2, 1, 1), (4, 8, 3, 1), (8, 4, 2, 3), (2, 16, 2, 1),
                                               (16, 4, 1, 2), (16, 16, 3, 1)])
def test_kernel_matches_reference(k_bits, v_bits, G, q, device, cases):
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=2, T=45, device=device)
    query = torch.randn(2, 2 * G, q, 16, generator=torch.Generator().manual_seed(1)).to(device)
    _check(query, token_blocks(ks), token_blocks(vs), splits=2)
    ks, vs = cases.filled_pair(k_bits, v_bits, B=1, Hkv=2, T=48, device=device)  # no key residual left
    assert k_bits == 16 or not ks.residual.shape[2]
    query = torch.randn(1, 2 * G, q, 16, generator=torch.Generator().manual_seed(1)).to(device)
    _check(query, token_blocks(ks), token_blocks(vs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_bits,v_bits", [(4, 4), (2, 8), (16, 4)])
def test_kernel_reads_reserved_buffers(k_bits, v_bits, device, cases):
    """The runtime's stores reserve rows past the tokens they hold: codes and scales are strided views."""
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=2, T=45, device=device, reserve=90)
    for stream in (ks, vs):
        if k_bits != 16 or stream is vs:
            assert stream.buffers["codes"].capacity > stream.num_quantized  # spare rows: a strided view
    query = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(5)).to(device)
    _check(query, token_blocks(ks), token_blocks(vs), splits=2)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_after_gathers_uses_group_ids(device, cases):
    ks, vs = cases.filled_pair(2, 4, T=45, device=device)
    idx = cases.random_index(2, 2, 45, 26, seed=3, device=device)
    ks.gather(idx)
    vs.gather(idx)
    ks.append(torch.randn(2, 2, 5, 16).to(device))
    vs.append(torch.randn(2, 2, 5, 16).to(device))
    assert ks.group_ids is not None
    query = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(device)
    _check(query, token_blocks(ks), token_blocks(vs), splits=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_bits,v_bits,q", [(4, 2, 1), (16, 8, 2)])
def test_kernel_ragged_heads_never_read_padding(k_bits, v_bits, q, device, cases):
    ks, vs = cases.filled_pair(k_bits, v_bits, B=2, Hkv=3, T=45)
    kv, vv = token_blocks(ks), token_blocks(vs)
    lengths = torch.tensor([[45, 17, 3], [q, 30, 41]])
    kv = cases.poison(kv, *cases.ragged_counts(kv, lengths, seed=5))
    vv = cases.poison(vv, *cases.ragged_counts(vv, lengths, seed=6))
    to = dict(device=device)
    kv = attrs.evolve(kv, **{f.name: getattr(kv, f.name).to(**to) for f in attrs.fields(type(kv))
                             if isinstance(getattr(kv, f.name), torch.Tensor)})
    vv = attrs.evolve(vv, **{f.name: getattr(vv, f.name).to(**to) for f in attrs.fields(type(vv))
                             if isinstance(getattr(vv, f.name), torch.Tensor)})
    query = torch.randn(2, 6, q, 16, generator=torch.Generator().manual_seed(3)).to(device)
    _check(query, kv, vv, splits=3)
    want = cases.dense_oracle(query.cpu(), attrs.evolve(kv, **_cpu(kv)), attrs.evolve(vv, **_cpu(vv)), 0.25)
    got = kivi_triton.decode_attention(query, kv, vv, scaling=0.25)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=1e-4)


def _cpu(stream):
    return {f.name: getattr(stream, f.name).cpu() for f in attrs.fields(type(stream))
            if isinstance(getattr(stream, f.name), torch.Tensor)}


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_bfloat16(device, cases):
    ks, vs = cases.filled_pair(4, 4, T=45, d=32, group_size=8, residual=16, dtype=torch.bfloat16, device=device)
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    # Triton's interpreter converts float32 to bf16 by truncation (a GPU rounds to nearest), both in the
    # dequantized tiles and in the output: a few bf16 ulps (2**-7 near 1) apart from the reference.
    _check(query, token_blocks(ks), token_blocks(vs), atol=4e-2 if device == "cpu" else 2e-2)


def test_kernel_rejects_mismatched_streams(cases):
    ks, vs = cases.filled_pair(4, 4, T=20)
    with pytest.raises(ValueError, match="keys must be per-channel"):
        kivi_triton.decode_attention(torch.randn(2, 2, 1, 16), token_blocks(vs), token_blocks(ks), scaling=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        kivi_triton.decode_attention(torch.randn(2, 3, 1, 16), token_blocks(ks), token_blocks(vs), scaling=1.0)
    short = attrs.evolve(token_blocks(vs), residual=token_blocks(vs).residual[:, :, :-1])
    with pytest.raises(ValueError, match="disagree on the per-head lengths"):
        kivi_triton.decode_attention(torch.randn(2, 2, 1, 16), token_blocks(ks), short, scaling=1.0)
    with pytest.raises(ValueError, match="queries' own tokens"):
        kivi_triton.decode_attention(torch.randn(2, 2, 21, 16), token_blocks(ks), token_blocks(vs), scaling=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_bits", [8, 16])     # 16: the 16-bit key view offers no kernel; the value view's runs
def test_attend_stores_runs_the_backend_it_is_asked_for(device, k_bits, cases):
    from polykv.attention.online_softmax import attend_stores

    ks, vs = cases.filled_pair(k_bits, 2, T=45, device=device)
    query = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(9)).to(device)
    fused = attend_stores(query, ks, vs, scaling=0.25, backend="fused")
    blockwise = attend_stores(query, ks, vs, scaling=0.25, backend="blockwise", block_size=8)
    torch.testing.assert_close(fused, blockwise, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend_stores(query, ks, vs, scaling=0.25, backend="sdpa")
    with pytest.raises(ValueError, match="offers no token blocks"):
        attend_stores(query, ks, object(), scaling=0.25)
