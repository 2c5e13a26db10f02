"""polykv.attention.kernels.sdpa runs masked attention in query-row chunks (a bounded mask, so a probe chunk
over a long prompt takes no (G q) x K float mask per layer): every chunking equals one masked SDPA call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polykv.attention import kernels as attention
from polykv.attention.kernels import sdpa
from polykv.attention.signals import lower_right_causal


def _one_call(query, key, value, scaling, mask):
    """Attention with the whole (.., q, K) mask at once, the G query heads repeated over K/V."""
    B, H, q, d = query.shape
    G = H // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    m = mask if mask.dim() == 2 else mask.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=m, scale=scaling)


@pytest.mark.parametrize("limit", [1, 7 * 3 * 20, 1 << 22])
@pytest.mark.parametrize("kind", ["causal", "visible", "valid"])
def test_row_chunks_equal_one_masked_call(monkeypatch, limit, kind):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, q, K, d = 2, 6, 2, 9, 20, 8
    query, key, value = (torch.randn(B, n, m, d, generator=g) for n, m in ((H, q), (Hkv, K), (Hkv, K)))
    causal = lower_right_causal(q, K, query.device)
    valid = visible = None
    want_mask = causal
    if kind == "visible":
        visible = causal & (torch.arange(K).view(1, K) > torch.arange(q).view(q, 1) + K - q - 6)   # a window of 6
        want_mask = visible
    if kind == "valid":
        valid = torch.rand(B, Hkv, K, generator=g) > 0.3
        valid[..., -q:] = True
        want_mask = causal & valid.unsqueeze(-2)
    monkeypatch.setattr(attention, "_SDPA_MASK_ELEMENTS", limit)
    got = sdpa(query, key, value, 0.3, valid, visible=visible)
    want = _one_call(query, key, value, 0.3, want_mask)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
