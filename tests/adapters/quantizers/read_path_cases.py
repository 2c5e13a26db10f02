"""Shared cases of the read-path tests: filled stores, ragged head counts, and a dense per-head oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polykv.adapters.quantizers.kivi import KiviQuantizer
from polykv.storage.token_blocks import with_head_counts


def filled_pair(k_bits, v_bits, *, B=2, Hkv=2, T=45, d=16, group_size=4, residual=8, dtype=torch.float32,
                seed=0, device="cpu", reserve=None):
    """A key store and a value store holding the same T random tokens (``reserve``: both first asked to
    reserve that many tokens, so their codes are views of larger buffers, as in the runtime)."""
    quant = KiviQuantizer(group_size=group_size, residual=residual)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, T, d, generator=g).to(device)
    v = torch.randn(B, Hkv, T, d, generator=g).to(device)
    ks = quant.new_store("key", k_bits, dtype=dtype, device=device)
    vs = quant.new_store("value", v_bits, dtype=dtype, device=device)
    if reserve is not None:
        ks.reserve(reserve)
        vs.reserve(reserve)
    for a in range(0, T, 13):  # appends of uneven chunks
        ks.append(k[:, :, a:a + 13])
        vs.append(v[:, :, a:a + 13])
    return ks, vs


def random_index(B, H, T, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, T, generator=g).argsort(-1)[..., :k].sort(-1).values.to(device)


def ragged_counts(stream, lengths, seed):
    """Random (quantized, residual) counts per head that add up to ``lengths`` [B, Hkv]."""
    Tq, Tr = stream.num_quantized, stream.residual.shape[2]
    g = torch.Generator().manual_seed(seed)
    lo = (lengths - Tr).clamp(min=0)
    hi = lengths.clamp(max=Tq)
    nq = lo + (torch.rand(lengths.shape, generator=g) * (hi - lo + 1).float()).long().clamp(max=hi - lo)
    return nq, lengths - nq


def poison(stream, nq, nr):
    """A copy of ``stream`` whose padding rows (past each head's counts) hold nan and huge values."""
    res = stream.residual.clone()
    codes = None if stream.codes is None else stream.codes.clone()
    scale = None if stream.codes is None else stream.scale.clone()
    B, H = res.shape[:2]
    for b in range(B):
        for h in range(H):
            res[b, h, int(nr[b, h]):] = float("nan")
            if codes is not None:
                codes[b, h, int(nq[b, h]):] = 255
                if stream.layout == "token":
                    scale[b, h, int(nq[b, h]):] = 1e30
    import attrs

    codes_ = {} if codes is None else {"codes": codes, "scale": scale}   # the 16-bit store's view holds no codes
    return with_head_counts(attrs.evolve(stream, residual=res, **codes_), nq, nr)


def dense_oracle(query, keys, values, scaling):
    """Per-head float64 attention over each head's own tokens (quantized prefix, then residual prefix)."""
    B, H, q, d = query.shape
    Hkv = keys.residual.shape[1]
    G = H // Hkv
    out = torch.empty(B, H, q, values.head_dim, dtype=torch.float64)

    def tokens(stream, b, h):
        nq = stream.num_quantized if stream.quantized_len is None else int(stream.quantized_len[b, h])
        nr = stream.residual.shape[2] if stream.residual_len is None else int(stream.residual_len[b, h])
        parts = [stream.residual[b, h, :nr]]
        if stream.codes is not None:
            parts.insert(0, stream.dequantize_rows(0, stream.num_quantized)[b, h, :nq])
        return torch.cat(parts).double().cpu()

    for b in range(B):
        for h in range(Hkv):
            k, v = tokens(keys, b, h), tokens(values, b, h)
            L = k.shape[0]
            mask = torch.arange(L).view(1, -1) <= (L - q + torch.arange(q)).view(-1, 1)
            qh = query[b, h * G:(h + 1) * G].double().cpu()  # (G, q, d)
            out[b, h * G:(h + 1) * G] = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scaling)
    return out
