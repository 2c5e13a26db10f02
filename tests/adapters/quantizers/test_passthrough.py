"""The 16-bit passthrough store: exact, in-place appends into a reserved buffer, resident bytes = the
buffer, gathers compacted in place."""

import pytest
import torch

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.storage.token_buffer import PassthroughStore
from polykv.registry import get_registry
from polykv.storage.token_buffer import GROWTH_BLOCK, capacity_after, grown_capacity
from polykv.storage.token_buffer import PassthroughStore as CorePassthroughStore


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_in_the_compute_dtype(dtype, device):
    x = torch.randn(2, 3, 17, 8, device=device).to(dtype)
    store = PassthroughStore(dtype=dtype, device=device)
    for a, b in ((0, 5), (5, 6), (6, 6), (6, 17)):
        store.append(x[:, :, a:b])
    assert len(store) == 17
    y = store.dequantize()
    assert y.dtype == dtype and y.device == x.device and torch.equal(y, x)
    assert store.resident_bytes() == 2 * 3 * grown_capacity(17) * 8 * y.element_size()


def test_the_adapters_path_re_exports_the_core_store():
    assert PassthroughStore is CorePassthroughStore


def test_appends_within_the_reserve_write_in_place_and_bytes_are_the_buffer():
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    big = torch.randn(1, 2, 100, 8)
    store.reserve(20)
    store.append(big[:, :, :10])          # a slice of a bigger tensor: the store copies it
    ptr = store.dequantize().data_ptr()
    for t in range(10, 20):
        store.append(big[:, :, t:t + 1])  # in place: the buffer is not reallocated
        assert store.dequantize().data_ptr() == ptr
        assert store.resident_bytes() == 1 * 2 * 20 * 8 * 4
    assert torch.equal(store.dequantize(), big[:, :, :20])
    store.append(big[:, :, 20:21])        # past the reserve: grows by one block counted from its size, once
    assert store.capacity == grown_capacity(21, 20) == 20 + GROWTH_BLOCK
    assert store.resident_bytes() == 2 * store.capacity * 8 * 4
    assert torch.equal(store.dequantize(), big[:, :, :21])
    assert capacity_after(21, 20) == store.capacity


def test_reserve_sets_the_room_exactly_and_never_drops_tokens():
    x = torch.randn(1, 2, 30, 4)
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    store.append(x)
    store.reserve(40)
    assert store.capacity == 40 and torch.equal(store.dequantize(), x)
    store.reserve(10)                     # never below what is stored
    assert store.capacity == 30 and torch.equal(store.dequantize(), x)


def test_gather_keeps_the_chosen_tokens_per_head():
    x = torch.randn(1, 2, 6, 4)
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    store.reserve(6)
    store.append(x)
    ptr = store.dequantize().data_ptr()
    store.gather(torch.tensor([[[0, 2, 5], [1, 3, 4]]]))
    assert torch.equal(store.dequantize()[0, 0], x[0, 0, [0, 2, 5]])
    assert torch.equal(store.dequantize()[0, 1], x[0, 1, [1, 3, 4]])
    assert store.dequantize().data_ptr() == ptr           # compacted in place
    assert store.resident_bytes() == 2 * 6 * 4 * 4        # the buffer stays until the store is asked to shrink
    store.append(x[:, :, :3])                             # refills the freed rows in place
    assert store.dequantize().data_ptr() == ptr and len(store) == 6


def test_sixteen_bits_means_passthrough_and_is_not_a_quantizer_name():
    store = KiviQuantizer().new_store("key", 16, dtype=torch.float32, device="cpu")
    assert isinstance(store, PassthroughStore)
    assert "passthrough" not in get_registry().names("quantizer")
    assert KiviQuantizer().predict_bytes("value", 16, batch=2, kv_heads=3, head_dim=8, tokens=5,
                                         dtype_bytes=2) == 2 * 3 * 8 * grown_capacity(5) * 2


def test_wrong_shapes_are_rejected():
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="empty"):
        store.dequantize()
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        store.append(torch.randn(2, 3, 4))
    store.append(torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="one store per layer"):
        store.append(torch.randn(1, 2, 3, 8))


def test_a_reserve_before_the_first_append_is_kept_even_for_an_empty_append():
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    store.reserve(12)
    store.append(torch.randn(1, 2, 0, 4))
    assert len(store) == 0 and store.capacity == 12
    store.append(torch.randn(1, 2, 5, 4))
    assert store.capacity == 12 and store.resident_bytes() == 2 * 12 * 4 * 4
