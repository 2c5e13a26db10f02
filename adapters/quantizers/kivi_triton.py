"""Triton decode attention straight from KIVI codes: no dequantized copy of the cache is made.

One program handles one (batch row, KV head) and one split of its tokens (flash-decoding): it
loads the G folded query rows once, then walks its tokens ``BLOCK_N`` at a time, dequantizing each
key and value tile in registers (int2/int4/int8 codes unpacked from their bytes, times the scale,
plus the minimum; per-channel key groups of G tokens, optionally through ``group_ids``; per-token
value groups of G channels), taking the full-precision residual rows where a token is past the
head's quantized part, and folds the tile into a running max / denominator / weighted sum. The
splits' partial results are merged by a second small kernel (the same recurrence as
``polykv.attention.online_softmax.combine_partials``), which writes the output in the query's dtype.

Ragged heads: every head reads its own quantized and residual counts, and a row sees token ``j``
only if ``j <= L - q + i`` (L the head's length, i the query's index among the q new ones), so
padding is never loaded into the softmax.

Runs on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter; slow, for
tests). Install Triton with the ``kernels`` extra: ``pip install -e '.[kernels]'``.
"""

from __future__ import annotations

import torch

from polykv.contract import storage

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = None

LAYOUT_CODE = {"none": 0, "channel": 1, "token": 2}
BLOCK_N = 32
"""Tokens per tile."""


def available() -> bool:
    """True when Triton is importable."""
    return triton is not None


def interpreting() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before import)."""
    return triton is not None and type(_decode_kernel).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _tile(n, c, cmask, codes, s_ct, scale, zero, s_st, gid, s_gt, res, s_rt, nq, nr,
              LAYOUT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_GID: tl.constexpr):
        """Tokens ``n`` [BN] x channels ``c`` [BD] of one head, dequantized: [BN, BD] float32."""
        in_r = (n >= nq) & (n < nq + nr)
        rm = in_r[:, None] & cmask[None, :]
        x = tl.load(res + (n - nq)[:, None] * s_rt + c[None, :], mask=rm, other=0.0).to(tl.float32)
        if LAYOUT != 0:
            in_q = n < nq
            qm = in_q[:, None] & cmask[None, :]
            PER: tl.constexpr = 8 // BITS
            byte = tl.load(codes + n[:, None] * s_ct + (c // PER)[None, :], mask=qm, other=0).to(tl.int32)
            code = ((byte >> ((c % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
            if LAYOUT == 1:  # keys: per channel, one scale row per group of GROUP tokens
                if HAS_GID:
                    row = tl.load(gid + n * s_gt, mask=in_q, other=0).to(tl.int32)
                else:
                    row = n // GROUP
                off = row[:, None] * s_st + c[None, :]
            else:  # values: per token, one scale per GROUP channels
                off = n[:, None] * s_st + (c // GROUP)[None, :]
            s = tl.load(scale + off, mask=qm, other=0.0).to(tl.float32)
            z = tl.load(zero + off, mask=qm, other=0.0).to(tl.float32)
            deq = (code * s + z).to(res.dtype.element_ty).to(tl.float32)  # the store's rounding
            x = tl.where(qm, deq, x)
        return x

    @triton.jit
    def _decode_kernel(Q, s_qbh, s_qm,
                       KC, KS, KZ, KG, KR, k_cbh, k_ct, k_sbh, k_st, k_gbh, k_gt, k_rbh, k_rt,
                       VC, VS, VZ, VR, v_cbh, v_ct, v_sbh, v_st, v_rbh, v_rt,
                       KNQ, KNR, VNQ, VNR, k_nq, k_nr, v_nq, v_nr, OACC, OM, OL,
                       scaling, chunk, M, Q_LEN, D, RAGGED: tl.constexpr,
                       K_LAYOUT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                       K_HAS_GID: tl.constexpr, V_LAYOUT: tl.constexpr, V_BITS: tl.constexpr,
                       V_GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (bh, split): rows [M] of one (batch, KV head) over tokens [split * chunk, +chunk)."""
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        nsplit = tl.num_programs(1)
        if RAGGED:  # each head's own counts; one integer type for every loop bound and mask
            knq = tl.load(KNQ + bh).to(tl.int32)
            knr = tl.load(KNR + bh).to(tl.int32)
            vnq = tl.load(VNQ + bh).to(tl.int32)
            vnr = tl.load(VNR + bh).to(tl.int32)
        else:  # every head holds the same counts, passed by value
            knq = k_nq.to(tl.int32)
            knr = k_nr.to(tl.int32)
            vnq = v_nq.to(tl.int32)
            vnr = v_nr.to(tl.int32)
        L = knq + knr
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        c = tl.arange(0, BLOCK_D)
        cmask = c < D
        q = tl.load(Q + bh * s_qbh + rows[:, None] * s_qm + c[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        limit = L - Q_LEN + rows % Q_LEN  # row g*q + i sees token j iff j <= L - q + i
        kc, ks, kz, kg, kr = KC + bh * k_cbh, KS + bh * k_sbh, KZ + bh * k_sbh, KG + bh * k_gbh, KR + bh * k_rbh
        vc, vs, vz, vr = VC + bh * v_cbh, VS + bh * v_sbh, VZ + bh * v_sbh, VR + bh * v_rbh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = split * chunk
        stop = tl.minimum(start + chunk, L)
        for s0 in range(start, stop, BLOCK_N):
            n = s0 + tl.arange(0, BLOCK_N)
            k = _tile(n, c, cmask, kc, k_ct, ks, kz, k_st, kg, k_gt, kr, k_rt, knq, knr,
                      K_LAYOUT, K_BITS, K_GROUP, K_HAS_GID)
            logits = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)),
                            input_precision=DOT_PREC) * scaling  # [BM, BN] float32
            see = (n[None, :] <= limit[:, None]) & (n[None, :] < stop)
            logits = tl.where(see, logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - shift)
            p = tl.exp(logits - shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(n, c, cmask, vc, v_ct, vs, vz, v_st, vc, 0, vr, v_rt, vnq, vnr,
                      V_LAYOUT, V_BITS, V_GROUP, False)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                                input_precision=DOT_PREC)
            m_i = m_new
        o = (bh * nsplit + split) * M + rows
        tl.store(OACC + o[:, None] * D + c[None, :], acc, mask=rmask[:, None] & cmask[None, :])
        tl.store(OM + o, m_i, mask=rmask)
        tl.store(OL + o, l_i, mask=rmask)

    @triton.jit
    def _combine_kernel(OACC, OM, OL, OUT, S, M, D,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program bh: merge the S splits' (m, l, acc) of its rows and write acc / l in OUT's dtype."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        c = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (c < D)[None, :]
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for sp in range(0, S):
            o = (bh * S + sp) * M + rows
            m = tl.load(OM + o, mask=rmask, other=float("-inf"))
            l = tl.load(OL + o, mask=rmask, other=0.0)
            a = tl.load(OACC + o[:, None] * D + c[None, :], mask=mask, other=0.0)
            m_new = tl.maximum(m_run, m)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            wa = tl.exp(m_run - shift)
            wb = tl.exp(m - shift)
            l_run = l_run * wa + l * wb
            acc = acc * wa[:, None] + a * wb[:, None]
            m_run = m_new
        out = acc / tl.where(l_run == 0, 1.0, l_run)[:, None]  # l = 0 only on padding rows (never stored)
        tl.store(OUT + (bh * M + rows)[:, None] * D + c[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _flat(t: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """[B, Hkv, T, c] -> a [B*Hkv, T, c] view with a contiguous last dim, and its (bh, token) strides."""
    if t is None or t.shape[2] == 0:
        t = fallback  # never read: every load from it is masked off
    t = t.reshape(t.shape[0] * t.shape[1], t.shape[2], -1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def _packed(view: storage.TokenRows) -> storage.TokenRows:
    """A KIVI view (per-channel keys or per-token values) or the 16-bit store's view (full-precision rows only,
    layout ``"none"``), as the kernel reads it; any other view is refused."""
    if view.layout not in LAYOUT_CODE or (view.layout == "none") != (view.codes is None):
        raise ValueError(f"the fused KIVI decode kernel reads KIVI streams and full-precision rows, not "
                         f"{type(view).__name__}")
    return view


def _stream_args(s: storage.TokenRows) -> tuple[list, list]:
    """(tensors, strides) of one stream for the kernel."""
    B, H, Tr, d = s.residual.shape
    anchor = s.residual if Tr else s.residual.new_zeros(B, H, 1, d)  # stands in for empty tensors
    res, r_bh, r_t = _flat(s.residual, anchor)
    if s.layout == "none":
        return [res, res, res, res], [r_bh, r_t, r_bh, r_t, r_bh, r_t]
    codes, c_bh, c_t = _flat(s.codes, anchor.to(torch.uint8))
    scale, s_bh, s_t = _flat(s.scale, anchor)
    zero, z_bh, z_t = _flat(s.zero, anchor)
    if (z_bh, z_t) != (s_bh, s_t):  # one set of strides serves both: make both contiguous
        scale, zero = scale.contiguous(), zero.contiguous()
        s_bh, s_t = scale.stride(0), scale.stride(1)
    return [codes, scale, zero, res], [c_bh, c_t, s_bh, s_t, r_bh, r_t]


def decode_attention(query: torch.Tensor, keys: storage.TokenRows, values: storage.TokenRows, *, scaling: float,
                     splits: int | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over packed keys and values: [B, H, q, d] in the query dtype.

    Parameters
    ----------
    query : torch.Tensor
        The q newest tokens' queries; they are the last q tokens of every head (lower-right causal).
    keys, values : storage.TokenRows (a KIVI view, or the 16-bit store's)
        Views of the layer's stores (``store.token_blocks()``: a KIVI store's, or the 16-bit store's), possibly
        with ragged head counts.
    scaling : float
        Logit scale (1 / sqrt(d) for most models).
    splits : int, optional
        Token splits per (batch, KV head); default: enough programs to fill the device.
    """
    if triton is None:
        raise RuntimeError("the fused KIVI decode kernel needs Triton: pip install -e '.[kernels]'")
    if query.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the fused KIVI decode kernel runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1); "
                           f"the query is on {query.device}: use polykv.attention.online_softmax.blockwise_attention instead, or "
                           f"set TRITON_INTERPRET=1 before this module is imported")
    if interpreting() and type(tl.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set (a model forward imports it), so "
                           "its language functions are compiled-only while this kernel is interpreted; set "
                           "TRITON_INTERPRET=1 before anything runs (e.g. in the environment)")
    keys, values = _packed(keys), _packed(values)
    B, H, q, d = query.shape
    Bk, Hkv, _, dk = keys.residual.shape
    if (Bk, dk) != (B, d) or tuple(values.residual.shape[:2]) != (B, Hkv) or values.head_dim != d or H % Hkv:
        raise ValueError(f"query {tuple(query.shape)} does not fit keys {tuple(keys.residual.shape)} / values "
                         f"{tuple(values.residual.shape)} (batch and head dim must match, H a multiple of Hkv)")
    if keys.layout == "token" or values.layout == "channel":
        raise ValueError("keys must be per-channel (or passthrough) and values per-token (or passthrough) streams")
    T = keys.padded_len
    klen, vlen = keys.lengths, values.lengths
    if klen is None and vlen is None:  # uniform heads: compare sizes on the host, no device round trip
        agree = values.padded_len == T
    else:
        kl = klen if klen is not None else torch.full((B, Hkv), T, dtype=torch.int64, device=query.device)
        vl = vlen if vlen is not None else torch.full((B, Hkv), values.padded_len, dtype=torch.int64,
                                                      device=query.device)
        agree = torch.equal(kl.to(vl.device), vl)
    if not agree:
        raise ValueError("keys and values disagree on the per-head lengths; a token must be kept or dropped in both")
    storage.check_lengths(klen, (B, Hkv), T, q)
    G, M = H // Hkv, (H // Hkv) * q
    rows = query.reshape(B * Hkv, M, d)  # (B*Hkv, G*q, d): GQA rows folded, keys never repeated
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    (kc, ks, kz, kr), kst = _stream_args(keys)
    (vc, vs, vz, vr), vst = _stream_args(values)
    kg = getattr(keys, "group_ids", None)   # a KIVI key view's group of each code row
    has_gid = kg is not None and keys.layout == "channel"
    kg, g_bh, g_t = _flat(kg.unsqueeze(-1), kc) if has_gid else (kc, 0, 0)
    block_n = BLOCK_N
    if splits is None:
        target = 4 if interpreting() else 2 * torch.cuda.get_device_properties(query.device).multi_processor_count
        splits = max(1, min(-(-T // block_n), -(-target // (B * Hkv))))
    chunk = -(-max(T, 1) // splits)
    chunk = -(-chunk // block_n) * block_n
    splits = -(-max(T, 1) // chunk)
    f32 = dict(dtype=torch.float32, device=query.device)
    acc = torch.empty(B * Hkv, splits, M, d, **f32)
    m = torch.empty(B * Hkv, splits, M, **f32)
    l = torch.empty(B * Hkv, splits, M, **f32)
    # Tensor-core operands in the compute dtype on a GPU; float32 in the interpreter (numpy has no bf16 matmul).
    half = keys.residual.dtype in (torch.bfloat16, torch.float16) and not interpreting()
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[keys.residual.dtype] if half else tl.float32
    prec = "tf32" if half else "ieee"
    ragged = keys.ragged or values.ragged
    if ragged:  # per-head counts in device memory
        counts = [t.reshape(-1).to(device=query.device, dtype=torch.int64).contiguous()
                  for stream in (keys, values) for t in stream.head_counts()]
    else:  # by value: no tensors to build per step
        counts = [kc] * 4
    uniform = [keys.num_quantized, keys.residual.shape[2], values.num_quantized, values.residual.shape[2]]
    _decode_kernel[(B * Hkv, splits)](
        rows, rows.stride(0), rows.stride(1),
        kc, ks, kz, kg, kr, kst[0], kst[1], kst[2], kst[3], g_bh, g_t, kst[4], kst[5],
        vc, vs, vz, vr, vst[0], vst[1], vst[2], vst[3], vst[4], vst[5],
        *counts, *uniform, acc, m, l,
        float(scaling), chunk, M, q, d, RAGGED=ragged,
        K_LAYOUT=LAYOUT_CODE[keys.layout], K_BITS=keys.bits if keys.layout != "none" else 8,
        K_GROUP=getattr(keys, "group_size", 1), K_HAS_GID=has_gid,
        V_LAYOUT=LAYOUT_CODE[values.layout], V_BITS=values.bits if values.layout != "none" else 8,
        V_GROUP=getattr(values, "group_size", 1), DOT_DTYPE=dot_dtype, DOT_PREC=prec,
        BLOCK_M=_pow2(M), BLOCK_N=block_n, BLOCK_D=_pow2(d),
        enable_fp_fusion=False)  # separate multiply and add, as the stores dequantize
    out = torch.empty(B * Hkv, M, d, dtype=query.dtype, device=query.device)
    _combine_kernel[(B * Hkv,)](acc, m, l, out, splits, M, d, BLOCK_M=_pow2(M), BLOCK_D=_pow2(d))
    return out.view(B, H, q, d)
