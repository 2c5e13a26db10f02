"""The code format's bit packing: exact round trip and the promised sizes (int4 = half a byte, int2 = a quarter)."""

import pytest
import torch

from polykv.adapters.quantizers.code_format import pack, packed_width, unpack, unpack_into


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_trip_and_size(bits, device):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 64), generator=g, dtype=torch.uint8).to(device)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, 5, 64 * bits // 8)
    assert packed.nbytes * 8 == codes.numel() * bits
    assert torch.equal(unpack(packed, bits), codes)


def test_layout_is_little_endian_within_a_byte():
    assert pack(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]


def test_width_must_fill_whole_bytes():
    with pytest.raises(ValueError, match="multiple of 4"):
        packed_width(6, 2)
    with pytest.raises(ValueError, match="supported widths"):
        packed_width(8, 3)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_unpack_into_a_strided_view_of_any_dtype(bits, dtype, device):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 16), generator=g, dtype=torch.uint8).to(device)
    dst = torch.full((2, 3, 9, 16), 9, device=device).to(dtype)
    before = dst.clone()
    unpack_into(dst[:, :, 2:7], pack(codes, bits), bits)  # a non-contiguous slice of a larger tensor
    assert torch.equal(dst[:, :, 2:7], codes.to(dtype))
    assert torch.equal(dst[:, :, :2], before[:, :, :2]) and torch.equal(dst[:, :, 7:], before[:, :, 7:])
