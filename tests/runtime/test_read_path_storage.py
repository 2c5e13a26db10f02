"""The read path over the runtime's layer storage: uniform stores and ragged per-head segments.

Attention read from the codes (no dequantized copy) equals SDPA over ``LayerStorage.view()``, the
dense padded view the runtime attends today, masked by its ``valid`` columns for a ragged layer.
"""

import torch
import torch.nn.functional as F

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.attention.online_softmax import attend_stores, per_head_attention, token_blocks
from polykv.runtime.storage import LayerStorage

B, HKV, G, D = 1, 2, 3, 16


def _storage(k_bits, v_bits):
    quant = KiviQuantizer(group_size=4, residual=8)
    return LayerStorage(lambda stream: quant.new_store(stream, k_bits if stream == "key" else v_bits,
                                                       dtype=torch.float32, device="cpu"))


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, n, D, generator=g), torch.randn(B, HKV, n, D, generator=g)


def test_uniform_storage_read_from_codes_equals_sdpa_over_its_view():
    storage = _storage(4, 2)
    k, v = _tokens(41, 0)
    storage.fill(k, v, torch.arange(41).expand(B, HKV, 41))
    k1, v1 = _tokens(1, 1)
    storage.append(k1, v1, 41)
    view = storage.view()
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(2))
    want = F.scaled_dot_product_attention(query, view.keys, view.values, scale=0.25, enable_gqa=True)
    got = attend_stores(query, storage.key_store, storage.value_store, scaling=0.25, block_size=16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_ragged_segments_read_per_head_equal_masked_sdpa_over_the_padded_view():
    storage = _storage(2, 4)
    k, v = _tokens(40, 3)
    storage.fill(k, v, torch.arange(40).expand(B, HKV, 40), counts=torch.tensor([[40, 23]]))
    k1, v1 = _tokens(1, 4)
    storage.append(k1, v1, 40)
    assert storage.ragged
    view = storage.view()  # right-aligned: padding first, valid marks each head's tokens
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(5))
    mask = view.valid.repeat_interleave(G, dim=1).unsqueeze(2)  # (B, H, 1, T)
    want = F.scaled_dot_product_attention(query, view.keys.repeat_interleave(G, 1),
                                          view.values.repeat_interleave(G, 1), attn_mask=mask, scale=0.25)
    pairs = [(token_blocks(seg.key), token_blocks(seg.value)) for seg in storage.segments]
    got = per_head_attention(query, pairs, scaling=0.25, block_size=16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
