"""KIVI gathers: survivors keep their codes and scales, error never compounds, groups are freed."""

import pytest
import torch

B, H, D = 2, 3, 16


def filled(make_store, stream, bits, T=45, seed=0, device="cpu"):
    store = make_store(stream, bits, device=device)
    x = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed)).to(device)
    store.append(x)
    return store, x


def take(x, idx):
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_key_gather_keeps_codes_and_group_scales_bit_identical(bits, device, make_store, random_index):
    store, _ = filled(make_store, "key", bits, device=device)
    tq = store.num_quantized
    codes, scale, zero, ids = store.codes.clone(), store.scale.clone(), store.zero.clone(), store.token_group_ids()
    idx = random_index(B, H, len(store), 20, seed=1, device=device)
    store.gather(idx)
    new_ids = store.token_group_ids()
    for b in range(B):
        for h in range(H):
            old = idx[b, h][idx[b, h] < tq]
            n = old.numel()
            assert torch.equal(store.codes[b, h, :n], codes[b, h, old])
            assert torch.equal(store.scale[b, h, new_ids[b, h, :n]], scale[b, h, ids[b, h, old]])
            assert torch.equal(store.zero[b, h, new_ids[b, h, :n]], zero[b, h, ids[b, h, old]])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_value_gather_keeps_codes_and_scales_bit_identical(bits, device, make_store, random_index):
    store, _ = filled(make_store, "value", bits, device=device)
    tq = store.num_quantized
    codes, scale, zero = store.codes.clone(), store.scale.clone(), store.zero.clone()
    idx = random_index(B, H, len(store), 20, seed=2, device=device)
    store.gather(idx)
    for b in range(B):
        for h in range(H):
            old = idx[b, h][idx[b, h] < tq]
            n = old.numel()
            assert torch.equal(store.codes[b, h, :n], codes[b, h, old])
            assert torch.equal(store.scale[b, h, :n], scale[b, h, old])
            assert torch.equal(store.zero[b, h, :n], zero[b, h, old])


@pytest.mark.parametrize("stream", ["key", "value"])
@pytest.mark.parametrize("bits", [2, 4])
def test_shared_gathers_never_change_a_survivor(stream, bits, device, make_store, random_index):
    """One index set for every head (as TOVA): repeated gathers and appends move nothing."""
    store, x = filled(make_store, stream, bits, T=60, device=device)
    before = store.dequantize()
    for step in range(6):
        idx = random_index(B, H, len(store), len(store) * 3 // 4, shared=True, seed=step, device=device)
        store.gather(idx)
        before = take(before, idx)
        assert torch.equal(store.dequantize(), before)
        new = torch.randn(B, H, 3, D, device=device)
        store.append(new)
        now = store.dequantize()
        # Old survivors are untouched by the append; the new tokens may be quantized (once) later.
        assert torch.equal(now[:, :, :before.shape[2] - store.residual_len], before[:, :, :-store.residual_len])
        before = now


@pytest.mark.parametrize("stream", ["key", "value"])
def test_per_head_gathers_quantize_each_token_at_most_once(stream, device, make_store, random_index):
    """Different survivors per head: once a survivor is quantized its value never changes again."""
    store, x = filled(make_store, stream, 2, T=60, device=device)
    origin = torch.arange(60, device=device).expand(B, H, 60)  # which input token each stored slot holds
    frozen = {}  # (b, h, input token) -> dequantized value once quantized
    inputs = x
    for step in range(8):
        k = max(len(store) - 7, 1)
        idx = random_index(B, H, len(store), k, seed=10 + step, device=device)
        store.gather(idx)
        origin = torch.gather(origin, 2, idx)
        new = torch.randn(B, H, 2, D, device=device)
        store.append(new)
        inputs = torch.cat([inputs, new], dim=2)
        n_in = inputs.shape[2]
        origin = torch.cat([origin, torch.arange(n_in - 2, n_in, device=device).expand(B, H, 2)], dim=2)
        y = store.dequantize()
        tq = store.num_quantized
        for b in range(B):
            for h in range(H):
                for slot in range(len(store)):
                    tok = int(origin[b, h, slot])
                    val = y[b, h, slot]
                    if slot >= tq:  # residual: the input itself
                        assert torch.equal(val, inputs[b, h, tok])
                    elif (b, h, tok) in frozen:
                        assert torch.equal(val, frozen[(b, h, tok)])
                    else:
                        frozen[(b, h, tok)] = val.clone()
    assert len(frozen) > 0


def test_a_key_group_is_freed_when_its_last_member_goes(make_store):
    store, _ = filled(make_store, "key", 4, T=32)  # 8 groups of 4 tokens, no residual
    assert store.scale.shape[2] == 8 and store.group_ids is None
    full = store.resident_bytes()
    idx = torch.tensor([0, 1, 9, 10, 11, 25]).expand(B, H, 6)  # members of groups 0, 2, 6
    store.gather(idx)
    assert store.scale.shape[2] == 3 and store.zero.shape[2] == 3
    assert store.token_group_ids()[0, 0].tolist() == [0, 0, 1, 1, 1, 2]
    # codes: 6 tokens x 8 bytes; 3 rows x 16 channels of scale + zero in float32; int32 group ids.
    expected = B * H * (6 * 8 + 2 * 3 * 16 * 4 + 6 * 4)
    assert store.resident_bytes() == expected < full


def test_per_head_group_rows_are_compacted_and_padded_to_the_longest_head(make_store):
    store, _ = filled(make_store, "key", 8, T=32)
    idx = torch.tensor([[[0, 4, 8, 12], [0, 1, 2, 3]] + [[0, 1, 4, 5]]] * B)  # 4, 1 and 2 groups
    store.gather(idx)
    assert store.scale.shape[2] == 4
    assert store.token_group_ids()[0].tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 1, 1]]


def test_resident_bytes_after_gathers_count_every_held_tensor(make_store, random_index):
    for stream in ("key", "value"):
        store, _ = filled(make_store, stream, 4, T=50)
        for step in range(3):
            store.gather(random_index(B, H, len(store), len(store) - 6, seed=step))
            store.append(torch.randn(B, H, 5, D))
        held = [store.codes, store.scale, store.zero, store.residual]
        if stream == "key":
            held.append(store.group_ids)
        for t in held:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert store.resident_bytes() == sum(t.nbytes for t in held)


def test_gather_indexes_logical_storage_order(make_store):
    """Index j means the j-th token of dequantize(): quantized part first, then the residual."""
    for stream in ("key", "value"):
        store, _ = filled(make_store, stream, 8, T=21)
        y = store.dequantize()
        idx = torch.tensor([3, 15, 17, 20]).expand(B, H, 4)
        store.gather(idx)
        # Shared survivors: the 2 residual survivors stay full precision, nothing is requantized.
        assert torch.equal(store.dequantize(), take(y, idx))


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([3, 1]), "ascending"),
    (torch.tensor([1, 1]), "ascending"),
    (torch.tensor([0, 99]), "out of range"),
    (torch.tensor([0.0, 1.0]), "integer"),
])
def test_bad_indices_are_rejected(bad, match, make_store):
    store, _ = filled(make_store, "key", 4, T=20)
    with pytest.raises(ValueError, match=match):
        store.gather(bad.expand(B, H, 2))
    with pytest.raises(ValueError, match="shape"):
        store.gather(torch.tensor([0, 1]))
