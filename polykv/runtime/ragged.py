"""The ragged half of a layer's storage (:class:`RaggedHeads`, which
:class:`~polykv.runtime.storage.LayerStorage` builds on): each (batch row, KV head) owns its own key store, value
store and positions (a :class:`Segment`), holding exactly its tokens, so memory is really freed. A layer turns
ragged when a ragged prompt is stored or a ragged selection first evicts; a uniform layer runs none of this.

Shapes: B batch, Hkv KV heads, W padded width (the longest head), n a head's own tokens, d head dim.
"""

from __future__ import annotations

import attrs
import torch

from polykv.storage.store import KVStore
from polykv.storage.token_buffer import TokenBuffer, reserve_store


@attrs.define
class Segment:
    """The tokens of one (batch row, KV head) of a ragged layer."""

    key: KVStore
    value: KVStore
    pos: TokenBuffer
    """[1, 1, n] int64 original positions, preallocated."""

    @property
    def positions(self) -> torch.Tensor:
        """[n] int64 (a view)."""
        return self.pos.view()[0, 0]

    @property
    def length(self) -> int:
        return self.pos.length


class RaggedHeads:
    """What :class:`~polykv.runtime.storage.LayerStorage` does once it is ragged (its ``segments`` set): the same
    calls as the uniform layout, one segment at a time."""

    def _fill_ragged(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     counts: torch.Tensor) -> None:
        """:meth:`~polykv.runtime.storage.LayerStorage.fill` with ``counts`` [B, Hkv]: head h keeps its last
        ``counts[b, h]`` columns (right-aligned) in its own stores."""
        B, H, K, _ = keys.shape
        self.segments = []
        for b in range(B):
            for h in range(H):
                n = int(counts[b, h])
                seg = Segment(key=self._new_store("key"), value=self._new_store("value"),
                              pos=self._new_positions(positions.device))
                rows = self._reserve_for(n, True)
                for store in (seg.key, seg.value, seg.pos):
                    reserve_store(store, rows)
                seg.key.append(keys[b:b + 1, h:h + 1, K - n:])
                seg.value.append(values[b:b + 1, h:h + 1, K - n:])
                seg.pos.append(positions[b:b + 1, h:h + 1, K - n:])
                self.segments.append(seg)
        self.contract.after("fill", self, keys=keys, values=values)

    def _append_ragged(self, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> None:
        q = keys.shape[2]
        for i, seg in enumerate(self.segments):
            b, h = divmod(i, self.shape[1])
            if self._exact_growth and seg.length + q > seg.pos.capacity:
                rows = self._reserve_for(seg.length + q, True)
                for store in (seg.key, seg.value, seg.pos):
                    reserve_store(store, rows)
            seg.key.append(keys[b:b + 1, h:h + 1])
            seg.value.append(values[b:b + 1, h:h + 1])
            seg.pos.append_arange(first_position, q)
        self.contract.after("append", self)

    def _padded_heads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head dequantized and padded to the longest, right-aligned: keys, values [B, Hkv, W, d] (zeros
        on padding), positions [B, Hkv, W] (-1 on padding) and ``valid`` [B, Hkv, W] (False on padding)."""
        c, (B, H) = self.contract, self.shape
        W = self.width()
        parts = [(c.read("key", seg.key.dequantize(), seg.length, 1, 1),
                  c.read("value", seg.value.dequantize(), seg.length, 1, 1)) for seg in self.segments]
        k0 = parts[0][0]
        keys = k0.new_zeros(B, H, W, k0.shape[-1])
        values = keys.new_zeros(B, H, W, parts[0][1].shape[-1])
        positions = torch.full((B, H, W), -1, dtype=torch.long, device=k0.device)
        valid = torch.zeros(B, H, W, dtype=torch.bool, device=k0.device)
        for i, ((k, v), seg) in enumerate(zip(parts, self.segments)):
            b, h = divmod(i, H)
            n = seg.length
            keys[b, h, W - n:], values[b, h, W - n:] = k[0, 0], v[0, 0]
            positions[b, h, W - n:] = seg.positions
            valid[b, h, W - n:] = True
        return keys, values, positions, valid

    def _evict_ragged(self, selection, view) -> None:
        """:meth:`~polykv.runtime.storage.LayerStorage.evict` once ragged, or by a ragged ``selection`` (which turns
        uniform storage ragged first: one segment per head, codes kept as they are)."""
        if not self.ragged:
            self._split()
        W, K = view.positions.shape[-1], selection.width
        counts = selection.head_counts().cpu()
        index = selection.index.cpu()
        for i, seg in enumerate(self.segments):
            b, h = divmod(i, self.shape[1])
            n, stored = int(counts[b, h]), seg.length
            cols = index[b, h, K - n:] - (W - stored)                     # padded column -> segment index
            if n and int(cols.min()) < 0:
                raise ValueError(f"the selection keeps a padding column of batch row {b}, KV head {h}")
            idx = cols.view(1, 1, n).to(seg.pos.device)
            rows = self._reserve_for(n, True)
            for store in (seg.key, seg.value, seg.pos):
                store.gather(idx)
                reserve_store(store, rows)
        self.contract.after("gather", self)

    def _write_ragged(self, stream: str, mask: torch.Tensor, x: torch.Tensor) -> None:
        W = x.shape[2]
        for i, seg in enumerate(self.segments):
            b, h = divmod(i, self.shape[1])
            n = seg.length
            m = mask[b:b + 1, h:h + 1, W - n:]
            if bool(m.any()):
                store = seg.key if stream == "key" else seg.value
                self.write_cost += self.contract.written(stream, store, m, store.write(m, x[b:b + 1, h:h + 1, W - n:]))
        self.contract.after("write", self)

    def _split(self) -> None:
        """Turn uniform storage ragged: one segment per (batch row, head), codes kept as they are."""
        keys, values = self.key_store.split_heads(), self.value_store.split_heads()
        H = self.shape[1]
        positions = self._pos.view()
        self.segments = []
        for i, (k, v) in enumerate(zip(keys, values)):
            pos = self._new_positions(positions.device)
            pos.reserve(positions.shape[-1])
            pos.append(positions[i // H:i // H + 1, i % H:i % H + 1])
            self.segments.append(Segment(key=k, value=v, pos=pos))
        self.key_store = self.value_store = None
        self._pos = None


def over_budget(totals: list[int], Hkv: int, capacity: int, head_capacity: torch.Tensor | None, slack: int) -> bool:
    """True when some batch row stores more than the layer's budget: ``(capacity + slack) * Hkv`` tokens over
    its KV heads (the per-head budgets' sum + ``slack * Hkv`` when an allocator gave them); ``totals``: tokens
    each batch row stores over its heads. With every head holding the same count this is "some head holds more
    than capacity + slack"."""
    budget = capacity * Hkv if head_capacity is None else int(head_capacity.sum())
    return any(t > budget + slack * Hkv for t in totals)
