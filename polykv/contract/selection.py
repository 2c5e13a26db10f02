"""What a retention rule returns: the kept tokens of every KV head, and optionally a merge.

A :class:`Selection` names, per batch row and KV head, the storage columns a layer keeps. Heads may
keep different numbers of tokens (``counts``): the layer's storage then becomes *ragged*, each head
holding exactly its own tokens. Ragged index tensors are right-aligned: head ``h`` keeps the last
``counts[b, h]`` entries of ``index[b, h]`` (strictly ascending); the entries before them are
padding and are never read. Right alignment matches the runtime's storage, where every head's
newest token is in the last column, so per-token state tensors stay aligned with storage by a
plain ``gather`` with the same index.

A :class:`Merge` moves information from evicted tokens into kept ones before the evicted tokens
are dropped (CaM, D2O): for every kept column ``j`` of a merged stream::

    x'_j = target_scale[j] * x_j + sum over (e, m) with targets[e, m] == j of weights[e, m] * x_{evicted[e]}

Everything is expressed in storage columns of the layer *before* the selection.

Shapes: B batch, Hkv KV heads, T stored tokens, K kept width, E evicted tokens that merge, M merge
targets per evicted token, d head dim.
"""

from __future__ import annotations

import attrs
import torch

STREAMS = ("key", "value")


@attrs.define(frozen=True, kw_only=True)
class Merge:
    """Evicted tokens folded into kept tokens (see the module docstring for the formula)."""

    evicted: torch.Tensor
    """[B, Hkv, E] int64 storage columns of evicted tokens that merge (any valid column where unused)."""
    targets: torch.Tensor
    """[B, Hkv, E, M] int64 storage columns of *kept* tokens that receive them."""
    weights: torch.Tensor
    """[B, Hkv, E, M] float weights; 0 is a no-op (use it to pad heads that merge fewer tokens)."""
    target_scale: torch.Tensor | None = None
    """[B, Hkv, T] float factor on every kept token before the sums are added (None = 1)."""
    streams: frozenset[str] = attrs.field(default=frozenset({"value"}), converter=frozenset)
    """Which streams merge: ``{"value"}`` (CaM) or ``{"key", "value"}`` (D2O)."""

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged copy of ``x`` [B, Hkv, T, d] and the columns it changed, [B, Hkv, T] bool.

        Computed in float32; returned in ``x.dtype``. Evicted columns are left as they were (they
        are dropped by the selection).
        """
        B, H, T, d = x.shape
        xf = x.float()
        out = xf.clone() if self.target_scale is None else xf * self.target_scale.float().unsqueeze(-1)
        E, M = self.targets.shape[2], self.targets.shape[3]
        src = xf.gather(2, self.evicted.unsqueeze(-1).expand(B, H, E, d))                     # (B, H, E, d)
        add = self.weights.float().unsqueeze(-1) * src.unsqueeze(3)                            # (B, H, E, M, d)
        at = self.targets.reshape(B, H, E * M)
        out.scatter_add_(2, at.unsqueeze(-1).expand(B, H, E * M, d), add.reshape(B, H, E * M, d))
        touched = torch.zeros(B, H, T, dtype=torch.bool, device=x.device)
        touched.scatter_(2, at, (self.weights != 0).reshape(B, H, E * M))
        if self.target_scale is not None:
            touched |= self.target_scale != 1
        return out.to(x.dtype), touched


@attrs.define(frozen=True, kw_only=True)
class Selection:
    """The tokens a layer keeps, per KV head, with an optional merge."""

    index: torch.Tensor
    """[B, Hkv, K] int64 storage columns, strictly ascending over each head's kept entries."""
    counts: torch.Tensor | None = None
    """[B, Hkv] int64 kept tokens per head (ragged); None means every head keeps all K entries."""
    merge: Merge | None = None
    """Evicted tokens folded into kept ones before eviction, or None."""

    @property
    def ragged(self) -> bool:
        return self.counts is not None

    @property
    def width(self) -> int:
        return int(self.index.shape[-1])

    def kept_mask(self) -> torch.Tensor:
        """[B, Hkv, K] bool: True where ``index`` holds a kept column (False = padding)."""
        K = self.width
        if self.counts is None:
            return torch.ones(self.index.shape, dtype=torch.bool, device=self.index.device)
        return torch.arange(K, device=self.index.device) >= (K - self.counts.to(self.index.device)).unsqueeze(-1)

    def head_counts(self) -> torch.Tensor:
        """[B, Hkv] int64 kept tokens per head."""
        if self.counts is not None:
            return self.counts.long()
        B, H, K = self.index.shape
        return torch.full((B, H), K, dtype=torch.long, device=self.index.device)


def as_selection(result: torch.Tensor | Selection) -> Selection:
    """A rule's return value as a :class:`Selection` (a bare index tensor keeps K tokens on every head)."""
    return result if isinstance(result, Selection) else Selection(index=result)


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, ascending; ties keep the earlier token.

    A stable descending sort orders equal scores by position and never reorders unequal ones,
    whatever the length (no score is perturbed), in the scores' own dtype.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def ragged_top_k(scores: torch.Tensor, counts: torch.Tensor) -> Selection:
    """Per head, the ``counts[b, h]`` highest of ``scores`` [B, Hkv, T], as a right-aligned ragged Selection.

    Ties keep the earlier token; padding entries hold column 0. ``-inf`` scores (e.g. padding
    columns) are only chosen when a head asks for more tokens than it has finite scores.
    """
    counts = counts.to(device=scores.device, dtype=torch.long)
    K = int(counts.max()) if counts.numel() else 0
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]        # (B, H, K)
    keep = torch.arange(K, device=scores.device) < counts.unsqueeze(-1)
    keyed = torch.where(keep, order, torch.full_like(order, -1))
    index = torch.sort(keyed, dim=-1).values.clamp_min(0)
    return Selection(index=index, counts=counts)


def newest_tokens(batch: int, kv_heads: int, stored: int, capacity: int, device: torch.device) -> torch.Tensor:
    """[B, Hkv, capacity] indices of the newest ``capacity`` of ``stored`` tokens, the same on every head
    (what a windowed rule keeps when its observation window fills the whole capacity)."""
    last = torch.arange(stored - capacity, stored, device=device)
    return last.view(1, 1, capacity).expand(batch, kv_heads, capacity).clone()
