"""The layout-independent online softmax: blocks and partial results combine to the exact softmax."""

import pytest
import torch

from polykv.attention.online_softmax import OnlineSoftmax, blockwise_attention, combine_partials, token_blocks, visible


def _data(seed=0, rows=5, T=37, dv=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, rows, T, generator=g) * 4
    values = torch.randn(2, 3, T, dv, generator=g)
    return logits, values


@pytest.mark.parametrize("block", [1, 4, 37])
def test_blocks_combine_to_softmax(block):
    logits, values = _data()
    state = OnlineSoftmax((2, 3, 5), 6, torch.device("cpu"))
    for a in range(0, 37, block):
        state.add(logits[..., a:a + block], values[..., a:a + block, :])
    torch.testing.assert_close(state.result(), torch.softmax(logits, -1) @ values, atol=1e-6, rtol=1e-5)


def test_masked_columns_and_fully_masked_blocks():
    logits, values = _data(1)
    mask = torch.rand(logits.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[..., 0] = True                      # every row sees something
    mask[..., 10:20] = False                 # a block no row sees
    masked = logits.masked_fill(~mask, float("-inf"))
    state = OnlineSoftmax((2, 3, 5), 6, torch.device("cpu"))
    for a in (10, 0, 20):  # order does not matter; the second block starts from a fully masked state
        b = {10: 20, 0: 10, 20: 37}[a]
        state.add(masked[..., a:b], values[..., a:b, :])
    torch.testing.assert_close(state.result(), torch.softmax(masked, -1) @ values, atol=1e-6, rtol=1e-5)


def test_partials_combine_like_one_pass():
    logits, values = _data(3)
    parts = []
    for a, b in ((0, 9), (9, 9), (9, 30), (30, 37)):  # including an empty part
        s = OnlineSoftmax((2, 3, 5), 6, torch.device("cpu"))
        if b > a:
            s.add(logits[..., a:b], values[..., a:b, :])
        parts.append(s)
    m, l, acc = (torch.stack([getattr(p, f) for p in parts], dim=2) for f in ("m", "l", "acc"))
    want = torch.softmax(logits, -1) @ values
    torch.testing.assert_close(combine_partials(m, l, acc, dim=2), want, atol=1e-6, rtol=1e-5)
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p.m, p.l, p.acc)
    torch.testing.assert_close(merged.result(), want, atol=1e-6, rtol=1e-5)


def test_a_row_with_nothing_visible_is_an_error():
    state = OnlineSoftmax((1, 2), 3, torch.device("cpu"))
    state.add(torch.full((1, 2, 4), float("-inf")), torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="saw no visible key"):
        state.result()


def test_visible_is_lower_right_causal_per_head():
    lengths = torch.tensor([[6, 4]])
    seen = visible(2, 2, 0, 6, lengths, 6, torch.device("cpu"))  # (1, 2, G*q = 4, 6)
    for h, L in enumerate((6, 4)):
        for row in range(4):
            i = row % 2
            assert seen[0, h, row].tolist() == [j <= L - 2 + i for j in range(6)]
    assert visible(1, 4, 0, 6, None, 6, torch.device("cpu")) is None


class _Dense:
    """A plain tensor as a token-blocks stream (what any store could offer)."""

    def __init__(self, x):
        self.x, self.padded_len, self.lengths = x, x.shape[2], None

    def read(self, start, stop):
        return self.x[:, :, start:stop]


class _Store:
    def __init__(self, x):
        self.x = x

    def token_blocks(self):
        return _Dense(self.x)


def test_blockwise_attention_over_any_token_blocks_stream():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 19, 8, generator=g), torch.randn(1, 2, 19, 8, generator=g)
    got = blockwise_attention(q, token_blocks(_Store(k)), token_blocks(_Store(v)), scaling=0.5, block_size=4)
    mask = torch.ones(3, 19, dtype=torch.bool).tril(16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert token_blocks(object()) is None


def test_attend_stores_never_substitutes_a_backend():
    from polykv.attention.online_softmax import attend_stores

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 1, 9, 8, generator=g), torch.randn(1, 1, 9, 8, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(attend_stores(q, _Store(k), _Store(v), scaling=0.5), want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="offer no fused kernel"):
        attend_stores(q, _Store(k), _Store(v), scaling=0.5, backend="fused")
