"""KIVI round trip: error within half a step, packed sizes, residual semantics, exact byte prediction."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polykv.adapters.quantizers.kivi import KiviQuantizer


def element_scale(store):
    """[B, H, Tq, d] float32: the scale that applies to every quantized element of ``store``."""
    if type(store).__name__ == "KiviKeyStore":
        ids = store.token_group_ids()
        return torch.gather(store.scale.float(), 2, ids.unsqueeze(-1).expand(*ids.shape, store.scale.shape[-1]))
    return store.scale.float().repeat_interleave(store.group_size, dim=-1)


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_is_at_most_half_a_step(stream, bits, device, make_store):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(2, 3, 45, 16, generator=g) * torch.linspace(0.1, 5, 16)).to(device)
    store = make_store(stream, bits, device=device)
    store.append(x)
    y = store.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    tq = store.num_quantized
    assert tq > 0
    bound = element_scale(store) / 2
    err = (y[:, :, :tq] - x[:, :, :tq]).abs()
    assert bool((err <= bound * (1 + 1e-5) + 1e-6).all()), float((err - bound).max())
    assert bool((bound > 0).all())
    # A coarser width really is coarser: the bound is not vacuous.
    assert float(err.max()) > 0


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("bits,per_element", [(8, 1.0), (4, 0.5), (2, 0.25)])
def test_codes_are_bit_packed(stream, bits, per_element, device, make_store):
    store = make_store(stream, bits, device=device)
    store.append(torch.randn(2, 3, 40, 16, device=device))
    codes = store.codes
    assert codes.dtype == torch.uint8
    elements = 2 * 3 * store.num_quantized * 16
    assert codes.nbytes == codes.numel() == elements * per_element


def test_constant_group_dequantizes_exactly(make_store):
    for stream in ("key", "value"):
        store = make_store(stream, 2)
        x = torch.full((1, 1, 16, 8), 0.3)
        store.append(x)
        assert torch.equal(store.dequantize(), x)


def test_key_blocks_quantize_only_when_complete(make_store):
    """Keys stay full precision until a block of R = 8 is complete; then the block is quantized."""
    x = torch.randn(1, 2, 21, 8)
    store = make_store("key", 4)
    store.append(x[:, :, :7])
    assert store.num_quantized == 0 and torch.equal(store.dequantize(), x[:, :, :7])
    store.append(x[:, :, 7:8])
    assert store.num_quantized == 8 and store.residual.shape[2] == 0
    store.append(x[:, :, 8:21])
    assert store.num_quantized == 16
    assert torch.equal(store.residual, x[:, :, 16:21])
    assert torch.equal(store.dequantize()[:, :, 16:], x[:, :, 16:21])
    assert not torch.equal(store.dequantize()[:, :, :16], x[:, :, :16])
    assert store.scale.shape == (1, 2, 16 // 4, 8)  # a row per group of G = 4 tokens, per channel


def test_values_keep_the_last_r_in_full_precision(make_store):
    x = torch.randn(1, 2, 21, 8)
    store = make_store("value", 4)
    store.append(x[:, :, :8])
    assert store.num_quantized == 0 and torch.equal(store.dequantize(), x[:, :, :8])
    for t in range(8, 21):
        store.append(x[:, :, t:t + 1])
        assert store.num_quantized == t + 1 - 8
        assert torch.equal(store.residual, x[:, :, t + 1 - 8:t + 1])
    assert store.scale.shape == (1, 2, 13, 8 // 4)  # per token, a group of G = 4 channels


def test_bfloat16_keeps_scales_and_output_in_the_compute_dtype(device, make_store):
    x = torch.randn(1, 2, 40, 16, device=device, dtype=torch.bfloat16)
    for stream in ("key", "value"):
        store = make_store(stream, 4, dtype=torch.bfloat16, device=device)
        store.append(x)
        y = store.dequantize()
        assert y.dtype == torch.bfloat16 and store.scale.dtype == torch.bfloat16 and store.zero.dtype == torch.bfloat16
        assert store.residual.dtype == torch.bfloat16
        tq = store.num_quantized
        err = (y[:, :, :tq].float() - x[:, :, :tq].float()).abs()
        bound = element_scale(store) / 2
        # bf16 rounds the stored scale and minimum: allow one bf16 ulp of the inputs on top.
        assert bool((err <= bound * 1.02 + x[:, :, :tq].float().abs() * 2 ** -7 + 1e-3).all())


chunkings = st.lists(st.integers(min_value=0, max_value=13), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(chunks=chunkings, bits=st.sampled_from([2, 4, 8, 16]), stream=st.sampled_from(["key", "value"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_predict_bytes_equals_resident_bytes_for_any_chunking(chunks, bits, stream, dtype):
    q = KiviQuantizer(group_size=4, residual=8)
    B, H, d = 2, 3, 16
    x = torch.randn(B, H, sum(chunks), d)
    store = q.new_store(stream, bits, dtype=dtype, device="cpu")
    whole = q.new_store(stream, bits, dtype=dtype, device="cpu")
    start = 0
    for n in chunks:
        store.append(x[:, :, start:start + n])
        start += n
    whole.append(x)
    predicted = q.predict_bytes(stream, bits, batch=B, kv_heads=H, head_dim=d, tokens=start,
                                dtype_bytes=torch.tensor([], dtype=dtype).element_size())
    assert store.resident_bytes() == predicted
    assert len(store) == start
    # The chunking changes nothing: same codes, same values, bit for bit.
    assert torch.equal(store.dequantize(), whole.dequantize())


def test_resident_bytes_count_exactly_the_held_tensors(make_store):
    """No store keeps a view of a larger buffer: storage bytes == element bytes for every tensor."""
    x = torch.randn(2, 16, 30, 8).transpose(1, 2)[:, :3]  # a non-contiguous view of a bigger tensor
    for stream in ("key", "value"):
        store = make_store(stream, 4)
        store.append(x[:, :, :13])
        store.append(x[:, :, 13:])
        held = [store.codes, store.scale, store.zero, store.residual]
        for t in held:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert store.resident_bytes() == sum(t.nbytes for t in held)


def test_default_parameters_match_the_reference():
    assert KiviQuantizer().params == {"group_size": 32, "residual": 32}
    # head_dim 64, 4-bit keys, 100 tokens, bf16: 96 quantized (3 groups of 32) + 4 residual.
    q = KiviQuantizer()
    assert q.predict_bytes("key", 4, batch=1, kv_heads=1, head_dim=64, tokens=100, dtype_bytes=2) == (
        96 * 32 + 2 * 3 * 64 * 2 + 4 * 64 * 2)
    # values: 68 quantized tokens (2 groups of 32 channels each) + the last 32 in bf16.
    assert q.predict_bytes("value", 4, batch=1, kv_heads=1, head_dim=64, tokens=100, dtype_bytes=2) == (
        68 * 32 + 2 * 68 * 2 * 2 + 32 * 64 * 2)
