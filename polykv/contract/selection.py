"""What a retention rule returns: the kept tokens of every KV head, and optionally a merge; and its check
(:func:`checked_selection`, always on: the runtime checks every selection a rule returns).

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

from polykv.errors import PluginContractError

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


# -- the check of what a rule's select() returned ------------------------------------------------------------
# Always on (shapes, ranges and order; no value is read beyond them): the runtime checks every selection a rule
# returns here, and polykv.testing calls the same check, so a broken rule fails with the same one line either way.

def checked_selection(result, ctx, capacity: int, *, where: str) -> Selection:
    """``result`` of ``rule.select(ctx, capacity)`` as a checked :class:`Selection`.

    Rectangular selections on uniform storage must be [B, Hkv, capacity]; every kept entry is a real
    (non-padding) column, strictly ascending per head (so unique); ragged counts never exceed a head's
    tokens and sum, per batch row, to at most ``capacity * Hkv`` (the sum of the per-head budgets when
    an allocator gave them). Ragged selections are trimmed to the longest head. A merge's targets must
    be kept tokens and its weights (and ``target_scale``) finite.
    """
    if not isinstance(result, (torch.Tensor, Selection)):
        raise PluginContractError(f"{where} select() returned a {type(result).__name__}; expected a [B, Hkv, k] "
                                  f"int64 tensor or a polykv.contract.selection.Selection (fix the rule's select())")
    sel = as_selection(result)
    idx = sel.index
    B, Hkv, T = ctx.positions.shape
    fix = "(fix the rule's select())"
    if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, Hkv):
        raise PluginContractError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                  f"expected ({B}, {Hkv}, k) int64 {fix}")
    if not sel.ragged and ctx.valid is None and ctx.head_capacity is None and idx.shape[2] != capacity:
        raise PluginContractError(f"{where} returned indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; "
                                  f"expected ({B}, {Hkv}, {capacity}) int64 {fix}")
    kept = None
    if sel.ragged:
        sel = _checked_counts(sel, ctx, capacity, where, fix)
        idx, kept = sel.index, sel.kept_mask()
    if idx.numel():
        inside = (idx >= 0) & (idx < T)
        steps = idx[..., 1:] > idx[..., :-1]
        if kept is not None:  # a ragged selection's padding columns are neither checked nor compared
            inside, steps = inside[kept], steps | ~kept[..., :-1]
        if not bool(inside.all()):
            raise PluginContractError(f"{where} returned indices outside [0, {T}) {fix}")
        if not bool(steps.all()):
            raise PluginContractError(f"{where} returned indices that are not strictly ascending within "
                                      f"[0, {T}) (a repeated or unsorted column) {fix}")
        if ctx.valid is not None:
            real = ctx.valid.gather(-1, idx.clamp(0, T - 1))
            if not bool((real if kept is None else real[kept]).all()):
                raise PluginContractError(f"{where} kept a padding column (ctx.valid is False there) {fix}")
    if sel.merge is not None:
        _check_merge(sel.merge, idx, sel.kept_mask() if kept is None else kept, B, Hkv, T, where, fix)
    return sel


def _checked_counts(sel: Selection, ctx, capacity: int, where: str, fix: str) -> Selection:
    """A ragged selection's per-head counts: none above a head's tokens, each batch row within the layer's budget;
    the selection trimmed to its longest head."""
    idx = sel.index
    B, Hkv = idx.shape[:2]
    counts = sel.head_counts().to(idx.device)
    lengths = ctx.head_lengths().to(idx.device)
    if tuple(counts.shape) != (B, Hkv) or bool((counts < 0).any()) or bool((counts > lengths).any()):
        raise PluginContractError(f"{where} returned per-head counts {counts.tolist()} for heads storing "
                                  f"{lengths.tolist()} tokens {fix}")
    budget = capacity * Hkv if ctx.head_capacity is None else ctx.head_capacity.sum(-1)
    if bool((counts.sum(-1) > torch.as_tensor(budget, device=idx.device)).any()):
        raise PluginContractError(f"{where} kept {counts.sum(-1).tolist()} tokens per batch row, more than the "
                                  f"layer's budget {torch.as_tensor(budget).tolist()} {fix}")
    K = int(counts.max()) if counts.numel() else 0
    return sel if idx.shape[2] == K else attrs.evolve(sel, index=idx[..., idx.shape[2] - K:])


def _check_merge(merge, idx, kept, B, Hkv, T, where, fix) -> None:
    E = merge.evicted.shape[-1]
    if (merge.evicted.dim() != 3 or tuple(merge.targets.shape[:3]) != (B, Hkv, E)
            or merge.weights.shape != merge.targets.shape or not merge.streams <= {"key", "value"}
            or (merge.target_scale is not None and tuple(merge.target_scale.shape) != (B, Hkv, T))):
        scale = None if merge.target_scale is None else tuple(merge.target_scale.shape)
        raise PluginContractError(f"{where} returned a merge of inconsistent shapes: evicted "
                                  f"{tuple(merge.evicted.shape)}, targets {tuple(merge.targets.shape)}, weights "
                                  f"{tuple(merge.weights.shape)}, target_scale {scale}, streams "
                                  f"{sorted(merge.streams)}; expected evicted [{B}, {Hkv}, E], targets and "
                                  f"weights [{B}, {Hkv}, E, M], target_scale [{B}, {Hkv}, {T}] {fix}")
    is_kept = torch.zeros(B, Hkv, T, dtype=torch.bool, device=idx.device)
    is_kept.scatter_(-1, idx.clamp(0, T - 1), kept)
    used = merge.weights != 0
    hits = is_kept.gather(-1, merge.targets.reshape(B, Hkv, -1).clamp(0, T - 1)).view_as(used)
    finite = torch.isfinite(merge.weights).all()
    if merge.target_scale is not None:
        finite = finite & torch.isfinite(merge.target_scale).all()
    inside = ((merge.evicted >= 0) & (merge.evicted < T)).all() & ((merge.targets >= 0) & (merge.targets < T)).all()
    if bool(hits[used].all() & finite & inside):  # one sync for the three
        return
    if not bool(inside):
        raise PluginContractError(f"{where} returned merge columns outside [0, {T}) {fix}")
    if not bool(finite):
        raise PluginContractError(f"{where} returned merge weights or target_scale that are not finite "
                                  f"(NaN or inf); expected finite weights {fix}")
    raise PluginContractError(f"{where} merges into tokens it does not keep (a target with a non-zero weight is "
                              f"not in the selection) {fix}")
