"""KIVI key storage: per-channel quantization in groups of G consecutive tokens, R-token residual.

KIVI: "A Tuning-Free Asymmetric 2bit Quantization for KV Cache", Liu et al., ICML 2024
(arXiv 2402.02750). Keys gather in full precision until a block of R tokens is complete; the
block is then quantized per channel, in R / G groups of G consecutive tokens (R % G == 0).

Layout (logical storage order = quantized tokens, then residual tokens):
``codes`` [B, Hkv, Tq, d * bits / 8] uint8; ``scale`` and ``zero`` [B, Hkv, Ng, d] in the compute
dtype, one row per group; ``group_ids`` [B, Hkv, Tq] int32, the group row of every quantized token,
or None while groups are implicit (token i belongs to group i // G, true until the first gather);
``residual`` [B, Hkv, Tr, d] in the compute dtype, Tr < R without eviction. Codes, scales, minima and
group ids are the rows in use of preallocated buffers (:mod:`polykv.adapters.quantizers.kivi_store`).
"""

from __future__ import annotations

import torch

from polykv.contract import storage
from polykv.adapters.quantizers.code_format import encode, group_params, pack, packed_width, quantize_groups
from polykv.adapters.quantizers.kivi_store import KiviStore


class KiviKeyStore(KiviStore):
    """Keys of one layer at ``bits`` in {2, 4, 8}; see the module docstring for the layout."""

    what, layout, _grow_in_blocks = "kivi keys", "channel", False

    def __init__(self, *, bits: int, group_size: int, residual: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(bits=bits, group_size=group_size, residual=residual, dtype=dtype, device=device,
                         ids=torch.int32)

    def _trails(self, d: int) -> dict[str, tuple[int, ...]]:
        return {"codes": (packed_width(d, self.bits),), "scale": (d,), "zero": (d,), "ids": ()}

    @property
    def group_ids(self) -> torch.Tensor | None:
        """[B, Hkv, Tq] int32 group row of every quantized token, or None while groups are implicit."""
        return self._rows("ids") if self._explicit_ids else None

    @property
    def _explicit_ids(self) -> bool:
        """Group ids are stored once a gather has kept quantized tokens (the ids buffer is empty otherwise)."""
        return self._buffers["ids"].length > 0

    def _set_groups(self, ids: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """New group rows and token group ids (None: implicit groups again; the ids buffer empties)."""
        B, H, _ = self._shape
        self._set("ids", ids if ids is not None else torch.empty(B, H, 0, dtype=torch.int32, device=self.device))
        self._set("scale", scale)
        self._set("zero", zero)

    def reserve(self, tokens: int) -> None:
        """Size the buffers so that appends up to ``tokens`` tokens in all write in place: keys quantize a
        block of ``residual`` at a time, so the quantized part can gain ``floor((tokens - Tq) / R)`` blocks
        of R code rows (and R / G group rows each)."""
        Tq, R = self.num_quantized, self.residual_len
        blocks = max(int(tokens) - Tq, 0) // R
        codes = Tq + blocks * R
        groups = self._buffers["scale"].length + blocks * (R // self.group_size)
        self._reserve_rows({"codes": codes, "scale": groups, "zero": groups,
                            "ids": codes if self._explicit_ids else 0})

    def token_group_ids(self) -> torch.Tensor:
        """[B, Hkv, Tq] int64: the group row of every quantized token (materialised if implicit)."""
        if self.group_ids is not None:
            return self.group_ids.long()
        B, H, _ = self._shape
        ids = torch.arange(self.num_quantized, device=self.device) // self.group_size
        return ids.expand(B, H, -1)

    # -- quantization -----------------------------------------------------------------------------
    def _to_quantize(self, held: int) -> int:
        """Every completed block of ``residual`` keys."""
        return held // self.residual_len * self.residual_len

    def _quantize_rows(self, x: torch.Tensor) -> None:
        """Quantize completed blocks x [B, H, n, d] (n a multiple of G) per channel, G tokens a group."""
        B, H, n, d = x.shape
        G = self.group_size
        codes, scale, zero = quantize_groups(x, (B, H, n // G, G, d), 3, self.bits, self.dtype)
        if self._explicit_ids:
            first = self.scale.shape[2]
            new_ids = first + torch.arange(n, device=self.device, dtype=torch.int32) // G
            self._put("ids", new_ids.expand(B, H, n))
        self._put("codes", codes)
        self._put("scale", scale)
        self._put("zero", zero)

    def gather(self, index: torch.Tensor) -> None:
        """Keep tokens ``index`` [B, Hkv, k] (strictly ascending, logical order); never requantizes.

        Survivors keep their codes; a group's scale and minimum are kept while any member survives
        in that head (rows are compacted per head and padded to the longest head). Heads may keep
        different numbers of residual tokens; every head keeps as many residual tokens as the head
        that kept fewest, and a head's older residual survivors are quantized now, once, as new
        groups of up to G of them per channel (their first quantization).
        """
        n_res, keep_res, nq, iq, ir, promoted = self._split_index(index)
        B, H, _ = self._shape
        Tq = self.num_quantized
        if Tq:
            at = iq.clamp(max=Tq - 1)
            codes = storage.gather_tokens(self.codes, at)
            ids = torch.gather(self.token_group_ids(), 2, at)
        else:
            codes = torch.zeros(B, H, nq, self.codes.shape[3], dtype=torch.uint8, device=self.device)
            ids = torch.zeros(B, H, nq, dtype=torch.int64, device=self.device)
        scale, zero = self.scale, self.zero
        n_promoted = int((n_res - keep_res).max()) if nq + keep_res else 0
        if nq and n_promoted:
            codes, ids, scale, zero = self._promote(iq, promoted, n_promoted, codes, ids)
        self._set("codes", codes)
        self._set_groups(*self._compact(ids, scale, zero))
        self.residual = storage.gather_tokens(self.residual, ir)

    def _promote(self, iq, promoted, n_promoted, codes, ids):
        """Quantize the residual survivors marked ``promoted`` [B, H, nq] as new groups of up to G."""
        B, H, d = self._shape
        G, Tq, first = self.group_size, self.num_quantized, self.scale.shape[2]
        x = storage.gather_tokens(self.residual, (iq - Tq).clamp(min=0)).float()  # (B, H, nq, d)
        n_new = -(-n_promoted // G)
        rank = torch.cumsum(promoted, dim=-1) - 1
        slot = torch.where(promoted, rank // G, torch.full_like(rank, n_new))  # n_new = discard row
        mn, mx = _row_extremes(x, slot, n_new + 1)
        empty = torch.isinf(mn[:, :, :n_new])  # a row no token of this head uses: never read, kept finite
        pscale, pzero = group_params(mn[:, :, :n_new].masked_fill(empty, 0.0),
                                     mx[:, :, :n_new].masked_fill(empty, 0.0), self.bits, self.dtype)
        row = slot.clamp(max=n_new - 1)
        q = encode(x, storage.gather_tokens(pscale, row), storage.gather_tokens(pzero, row), self.bits)
        codes = torch.where(promoted.unsqueeze(-1), pack(q, self.bits), codes)
        ids = torch.where(promoted, first + slot, ids)
        return (codes, ids, torch.cat([self.scale, pscale], dim=2), torch.cat([self.zero, pzero], dim=2))

    def _compact(self, ids: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        """Drop group rows no surviving token uses, per head; renumber ``ids`` [B, H, n] (non-decreasing)."""
        B, H, n = ids.shape
        d = scale.shape[3]
        if not n:
            empty = scale[:, :, :0].clone()
            return None, empty, zero[:, :, :0].clone()
        step = (ids[..., 1:] != ids[..., :-1]).long()
        new_ids = torch.cat([torch.zeros(B, H, 1, dtype=torch.long, device=ids.device),
                             torch.cumsum(step, dim=-1)], dim=-1)  # (B, H, n)
        rows = int(new_ids[..., -1].max()) + 1
        source = torch.zeros(B, H, rows, dtype=torch.long, device=ids.device).scatter_(2, new_ids, ids)
        # Rows past a head's own count repeat row 0's source: padding, never read by that head.
        return new_ids.to(torch.int32), storage.gather_tokens(scale, source), storage.gather_tokens(zero, source)

    def write(self, mask: torch.Tensor, x: torch.Tensor) -> storage.WriteCost:
        """Overwrite the tokens where ``mask`` [B, Hkv, T] is True with ``x`` [B, Hkv, T, d].

        Keys are quantized per channel over groups of tokens, so every group row holding a written
        quantized token is re-encoded: its scale and minimum are recomputed from the members' new
        values (written ones) and dequantized values (the others), and every member's codes are
        recomputed. Untouched groups keep their codes; residual tokens are replaced in full precision.
        """
        B, H, d = self._shape
        Tq = self.num_quantized
        mq, written = self._split_write(mask, x)     # the residual's tokens are written here
        members = rows = 0
        if bool(mq.any()):
            ids = self.token_group_ids()                                              # (B, H, Tq)
            new = torch.where(mq.unsqueeze(-1), x[:, :, :Tq].float(), self.dequantize()[:, :, :Tq].float())
            n_rows = self.scale.shape[2]
            row_hit = torch.zeros(B, H, n_rows, dtype=torch.long, device=self.device).scatter_add_(2, ids, mq.long()) > 0
            member_hit = row_hit.gather(2, ids)                                       # (B, H, Tq)
            mn, mx = _row_extremes(new, ids, n_rows)
            pscale, pzero = group_params(mn.masked_fill(~row_hit.unsqueeze(-1), 0.0),
                                                mx.masked_fill(~row_hit.unsqueeze(-1), 0.0), self.bits, self.dtype)
            self._set("scale", torch.where(row_hit.unsqueeze(-1), pscale, self.scale))
            self._set("zero", torch.where(row_hit.unsqueeze(-1), pzero, self.zero))
            scale, zero = storage.gather_tokens(self.scale, ids), storage.gather_tokens(self.zero, ids)
            q = encode(new, scale, zero, self.bits)
            self._set("codes", torch.where(member_hit.unsqueeze(-1), pack(q, self.bits), self.codes))
            members, rows = int(member_hit.sum()), int(row_hit.sum())
        return storage.WriteCost(tokens_written=written, tokens_requantized=members,
                                 groups_requantized=rows * d)

    def _fill_head(self, b: int, h: int) -> "KiviKeyStore":
        """Head (b, h)'s store; group rows that head does not use (padding of a per-head compaction) are dropped."""
        s = super()._fill_head(b, h)
        s._set("codes", self.codes[b:b + 1, h:h + 1])
        scale, zero = self.scale[b:b + 1, h:h + 1], self.zero[b:b + 1, h:h + 1]
        if self.group_ids is None:
            s._set_groups(None, scale, zero)
        else:
            s._set_groups(*s._compact(self.group_ids[b:b + 1, h:h + 1].long(), scale, zero))
        return s


def _row_extremes(x: torch.Tensor, rows: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum of the tokens ``x`` [B, H, n, d] that map to each of ``n_rows`` group
    rows (``rows`` [B, H, n]): two [B, H, n_rows, d] float32 tensors, +inf / -inf in a row no token maps to."""
    B, H, n, d = x.shape
    at = rows.unsqueeze(-1).expand(B, H, n, d)
    inf = torch.full((B, H, n_rows, d), float("inf"), device=x.device)
    return inf.scatter_reduce(2, at, x, "amin"), (-inf).scatter_reduce(2, at, x, "amax")


def key_bytes(*, bits: int, group_size: int, residual: int, batch: int, kv_heads: int, head_dim: int,
              tokens: int, dtype_bytes: int, reserved: int | None = None) -> int:
    """Resident bytes of a :class:`KiviKeyStore` after ``tokens`` appends and no eviction; ``reserved``:
    the store was first asked to ``reserve(reserved)`` (None: never, buffers of exactly their rows)."""
    tq = tokens // residual * residual
    tr = tokens - tq
    code_rows, group_rows = tq, tq // group_size
    if reserved is not None:
        blocks = int(reserved) // residual
        code_rows = max(tq, blocks * residual)                           # past the reserve: exactly what they need
        group_rows = max(tq // group_size, blocks * (residual // group_size))
    per_head = (code_rows * packed_width(head_dim, bits)                 # codes
                + 2 * group_rows * head_dim * dtype_bytes                # scale + minimum per group row
                + tr * head_dim * dtype_bytes)                           # full-precision residual
    return batch * kv_heads * per_head


def key_bound_bytes(*, bits: int, group_size: int, residual: int, batch: int, kv_heads: int, head_dim: int,
                    tokens: int, dtype_bytes: int) -> int:
    """Most resident bytes of a :class:`KiviKeyStore` holding at most ``tokens`` keys after any appends
    and gathers: per quantized key its codes, an int32 group id and (worst case, every survivor from
    another group) its own scale and minimum row; up to ``residual - 1`` keys in the compute dtype."""
    quantized = packed_width(head_dim, bits) + 4 + 2 * head_dim * dtype_bytes
    full = head_dim * dtype_bytes
    per_head = max((tokens - tr) * quantized + tr * full for tr in {0, min(residual - 1, tokens)})
    return batch * kv_heads * per_head


def key_reserved_bound_bytes(*, bits: int, group_size: int, residual: int, batch: int, kv_heads: int,
                             head_dim: int, tokens: int, dtype_bytes: int) -> int:
    """Most resident bytes of a :class:`KiviKeyStore` whose buffers never exceed ``tokens`` rows (it holds at
    most that many keys and is asked to reserve at most that many): per row its codes, an int32 group id
    and (worst case) its own scale and minimum row, plus up to ``residual - 1`` keys in the compute dtype."""
    per_head = (tokens * (packed_width(head_dim, bits) + 4 + 2 * head_dim * dtype_bytes)
                + min(residual - 1, tokens) * head_dim * dtype_bytes)
    return batch * kv_heads * per_head
