"""KIVI stores preallocate their quantized part: reserve() sizes the buffers, appends write in place, and the
bytes they hold are what predict_reserved_bytes / bound_reserved_bytes say."""

from __future__ import annotations

import pytest
import torch

from polykv.adapters.quantizers.kivi import KiviQuantizer

G, R, D = 4, 8, 16
SHAPE = dict(batch=2, kv_heads=3, head_dim=D, dtype_bytes=4)


def _store(stream, bits=4):
    return KiviQuantizer(group_size=G, residual=R).new_store(stream, bits, dtype=torch.float32, device="cpu")


def _tokens(n, seed=0):
    return torch.randn(2, 3, n, D, generator=torch.Generator().manual_seed(seed))


def _pointers(store):
    return {name: buf.data.data_ptr() for name, buf in store.buffers.items() if buf.data is not None}


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("prompt,reserved", [(37, 37), (37, 60), (5, 40), (40, 0), (3, 3)])
def test_reserved_bytes_equal_the_prediction_at_every_step(stream, prompt, reserved):
    q = KiviQuantizer(group_size=G, residual=R)
    store = _store(stream)
    store.reserve(reserved)
    x = _tokens(prompt + 40)
    store.append(x[:, :, :prompt])
    for t in range(prompt, prompt + 40):
        got = store.resident_bytes()
        want = q.predict_reserved_bytes(stream, 4, tokens=t, reserved=reserved, **SHAPE)
        assert got == want, f"{stream}: {t} tokens after reserving {reserved}: {got} B held, {want} B predicted"
        store.append(x[:, :, t:t + 1])


@pytest.mark.parametrize("stream", ["key", "value"])
def test_appends_within_the_reserve_write_in_place_and_match_an_unreserved_store(stream):
    reserved, x = 70, _tokens(70, seed=1)
    fixed, plain = _store(stream), _store(stream)
    fixed.reserve(reserved)
    fixed.append(x[:, :, :20])
    plain.append(x[:, :, :20])
    assert plain.resident_bytes() < fixed.resident_bytes()  # exact rows against the whole reserve
    before = _pointers(fixed)
    for t in range(20, reserved):
        fixed.append(x[:, :, t:t + 1])
        plain.append(x[:, :, t:t + 1])
    assert _pointers(fixed) == before, "an append within the reserve reallocated a buffer"
    assert torch.equal(fixed.dequantize(), plain.dequantize())
    assert fixed.num_quantized == plain.num_quantized > 0
    assert plain.resident_bytes() == fixed.resident_bytes()  # the reserve is full: no spare rows left


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("keep", [10, 23, 31])
def test_after_an_eviction_the_reserve_holds_every_later_append(stream, keep):
    """The runtime's cycle: gather the survivors, reserve(hold + 1), append until hold + 1, evict again;
    appends never reallocate and the bytes stay within bound_reserved_bytes."""
    q = KiviQuantizer(group_size=G, residual=R)
    hold = 40
    store = _store(stream)
    store.reserve(hold + 1)
    x = _tokens(400, seed=2)
    store.append(x[:, :, :hold + 1])
    gen = torch.Generator().manual_seed(3)
    bound = q.bound_reserved_bytes(stream, 4, tokens=hold, reserved=hold + 1, **SHAPE)
    t = hold + 1
    for _ in range(6):
        scores = torch.rand(2, 3, len(store), generator=gen)
        index = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
        store.gather(index)
        store.reserve(hold + 1)
        before = _pointers(store)
        assert store.resident_bytes() <= bound
        while len(store) < hold + 1:
            store.append(x[:, :, t:t + 1])
            t += 1
            assert _pointers(store) == before, f"{stream}: an append after the eviction reallocated"
            assert store.resident_bytes() <= bound


@pytest.mark.parametrize("stream", ["key", "value"])
def test_a_smaller_reserve_releases_rows(stream):
    store = _store(stream)
    store.reserve(200)
    store.append(_tokens(30))
    big = store.resident_bytes()
    store.reserve(30)
    assert store.resident_bytes() < big
    q = KiviQuantizer(group_size=G, residual=R)
    assert store.resident_bytes() == q.predict_reserved_bytes(stream, 4, tokens=30, reserved=30, **SHAPE)


def test_a_keep_everything_store_grows_in_blocks_not_every_step():
    """Values quantize one token per decode step; the buffers grow a GROWTH_BLOCK of rows at a time."""
    from polykv.storage.token_buffer import GROWTH_BLOCK

    store = _store("value")
    x = _tokens(100, seed=4)
    store.reserve(40)
    store.append(x[:, :, :40])
    ptr, moves = store.buffers["codes"].data.data_ptr(), 0
    for t in range(40, 100):
        store.append(x[:, :, t:t + 1])
        now = store.buffers["codes"].data.data_ptr()  # a new buffer is allocated while the old one lives
        moves, ptr = moves + (now != ptr), now
    assert moves == -(-60 // GROWTH_BLOCK)
