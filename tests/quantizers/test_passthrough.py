"""The 16-bit passthrough store: exact, amortised appends, exact resident bytes, gathers."""

import pytest
import torch

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.adapters.quantizers.passthrough import PassthroughStore
from polykv.registry import get_registry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_in_the_compute_dtype(dtype, device):
    x = torch.randn(2, 3, 17, 8, device=device).to(dtype)
    store = PassthroughStore(dtype=dtype, device=device)
    for a, b in ((0, 5), (5, 6), (6, 6), (6, 17)):
        store.append(x[:, :, a:b])
    assert len(store) == 17
    y = store.dequantize()
    assert y.dtype == dtype and y.device == x.device and torch.equal(y, x)
    assert store.resident_bytes() == 2 * 3 * 17 * 8 * y.element_size()


def test_appends_are_pending_chunks_and_bytes_stay_exact():
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    big = torch.randn(1, 2, 100, 8)
    store.append(big[:, :, :10])          # a slice of a bigger tensor: the store copies it
    for t in range(10, 14):
        store.append(big[:, :, t:t + 1])  # O(chunk) each: nothing is concatenated yet
        assert store.resident_bytes() == 1 * 2 * (t + 1) * 8 * 4
    assert len(store._chunks) == 5
    assert torch.equal(store.dequantize(), big[:, :, :14])
    assert len(store._chunks) == 1 and store.resident_bytes() == 2 * 14 * 8 * 4


def test_gather_keeps_the_chosen_tokens_per_head():
    x = torch.randn(1, 2, 6, 4)
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    store.append(x)
    store.gather(torch.tensor([[[0, 2, 5], [1, 3, 4]]]))
    assert torch.equal(store.dequantize()[0, 0], x[0, 0, [0, 2, 5]])
    assert torch.equal(store.dequantize()[0, 1], x[0, 1, [1, 3, 4]])
    assert store.resident_bytes() == 2 * 3 * 4 * 4


def test_sixteen_bits_means_passthrough_and_is_not_a_quantizer_name():
    store = KiviQuantizer().new_store("key", 16, dtype=torch.float32, device="cpu")
    assert isinstance(store, PassthroughStore)
    assert "passthrough" not in get_registry().names("quantizer")
    assert KiviQuantizer().predict_bytes("value", 16, batch=2, kv_heads=3, head_dim=8, tokens=5,
                                         dtype_bytes=2) == 2 * 3 * 8 * 5 * 2


def test_wrong_shapes_are_rejected():
    store = PassthroughStore(dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="empty"):
        store.dequantize()
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        store.append(torch.randn(2, 3, 4))
    store.append(torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="one store per layer"):
        store.append(torch.randn(1, 2, 3, 8))
