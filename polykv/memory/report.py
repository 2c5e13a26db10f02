"""A plan's memory report: per-layer and total nominal, resident and metadata bytes, and their table."""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from polykv.memory.resident import MemoryRow, predict_resident
from polykv.memory.tokens import plan_geometry
from polykv.models.kv_bases import bytes_of_bases
from polykv.registry import get_registry


@attrs.define(frozen=True, kw_only=True)
class MemoryReport:
    """Per-layer and total bytes of a plan at one context length, batch and dtype."""

    rows: tuple[MemoryRow, ...] = attrs.field(converter=tuple)
    context_tokens: int
    batch: int
    dtype_bytes: int
    phase: str
    group_bounds: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=tuple)
    """Per allocation group: (``allocator[first..last]``, most tokens per KV head over all its layers)."""
    group_layers: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=tuple)
    """Per allocation group (same order as ``group_bounds``): the layers it allocates over."""
    bases_bytes: int = 0
    """Bytes of the key/value bases the low-rank layers project with (compute dtype), held once per model
    whatever the batch and context: stated apart from the cache, in no total or ratio above."""
    expected_resident: int | None = None
    """Resident K+V bytes with every allocated layer at its planned capacity (the allocator's budget is their
    sum: it moves tokens between layers and heads, so the measured bytes differ from this only by the parts of
    a layer's bytes that do not grow with its tokens); None without allocation groups."""

    @property
    def nominal_total(self) -> int:
        return sum(r.nominal_bytes for r in self.rows)

    @property
    def resident_total(self) -> int:
        """Key + value store bytes over all layers (metadata excluded)."""
        return sum(r.resident_bytes for r in self.rows)

    @property
    def metadata_total(self) -> int:
        return sum(r.metadata_bytes for r in self.rows)

    @property
    def metadata_complete(self) -> bool:
        """False when some metadata could not be counted (query windows without ``num_heads``)."""
        return all(v is not None for r in self.rows for v in r.metadata.values())

    @property
    def full_total(self) -> int:
        """Bytes of an uncompressed K+V cache (compute dtype; 16-bit by default) holding the whole context."""
        return sum(r.full_bytes for r in self.rows)

    @property
    def ratio(self) -> float:
        """Compression ratio: full cache bytes / resident K+V bytes."""
        return self.full_total / self.resident_total

    @property
    def expected_resident_total(self) -> int | None:
        """:attr:`expected_resident` (the allocation groups at their budgets, not every layer at its bound)."""
        return self.expected_resident if any(r.bound for r in self.rows) else None

    @property
    def expected_ratio(self) -> float | None:
        """Full cache bytes / :attr:`expected_resident_total` (the allocator's budget); None without groups."""
        expected = self.expected_resident_total
        return self.full_total / expected if expected else None

    @property
    def ratio_with_metadata(self) -> float:
        """Full cache bytes / (resident K+V + counted metadata)."""
        return self.full_total / (self.resident_total + self.metadata_total)

    @property
    def nominal_ratio(self) -> float:
        """Nominal compression: 16-bit nominal bytes of the whole context / the plan's nominal bytes."""
        return sum(r.full_nominal_bytes for r in self.rows) / self.nominal_total

    def format_table(self) -> str:
        """A plain-text table: one line per layer, then totals and ratios."""
        head = ("layer", "prefill", "decode", "K", "V", "kept", "nominal B", "resident B", "metadata B")
        body = [(str(r.layer) + ("w" if r.window_bound is not None else ""), r.prefill, r.decode,
                 str(r.k_bits) + (f"r{r.k_rank}" if r.k_rank is not None else ""),
                 str(r.v_bits) + (f"r{r.v_rank}" if r.v_rank is not None else ""),
                 ("<=" if r.bound else "") + f"{r.kept_tokens:,}",
                 f"{r.nominal_bytes:,}", f"{r.resident_bytes:,}",
                 f"{r.metadata_bytes:,}" + ("" if None not in r.metadata.values() else "+?"))
                for r in self.rows]
        total = ("total", "", "", "", "", "", f"{self.nominal_total:,}", f"{self.resident_total:,}",
                 f"{self.metadata_total:,}" + ("" if self.metadata_complete else "+?"))
        lines = _align([head] + body + [total], right_from=3)
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        return "\n".join(lines + self.footer_lines())

    def footer_lines(self) -> list[str]:
        """The lines under the table: context, full-cache bytes and ratios, and what the marks mean."""
        ranks = any(r.k_rank is not None or r.v_rank is not None for r in self.rows)
        lines = [
            f"context {self.context_tokens:,} tokens, batch {self.batch}, {self.dtype_bytes}-byte compute dtype, "
            f"phase {self.phase} ({'right after prefill' if self.phase == 'prefill' else 'decode bound'})",
            f"full cache (whole context, compute dtype) {self.full_total:,} B; compression {self.ratio:.2f}x resident "
            f"({self.ratio_with_metadata:.2f}x with metadata), {self.nominal_ratio:.2f}x nominal"
            + ("" if self.expected_ratio is None else
               f"; about {self.expected_ratio:.2f}x resident at its allocators' budgets (the ratios before it "
               f"count every allocated layer at its bound)"),
        ]
        bounded = [r for r in self.rows if r.window_bound is not None]
        if bounded:
            lines.append(f"w = window-bounded layer ({len(bounded)} of {len(self.rows)}): keeps at most its model's "
                         f"window ({bounded[0].window_bound:,} tokens) whatever the plan says")
        if not self.metadata_complete:
            lines.append("+? query windows not counted: the geometry has no num_heads (pass num_heads=)")
        if any(r.bound for r in self.rows):
            lines.append("<= an allocator decides these layers' budgets after prefill: each row is that layer's own "
                         "bound, so the totals over-state the group (session.allocations() reports what was allocated)")
        if ranks:
            lines.append(f"rN = low-rank codes of N channels per token; their key/value bases take {self.bases_bytes:,} B "
                         f"once per model (not in the totals)")
        for name, tokens in self.group_bounds:
            lines.append(f"allocation group {name}: at most {tokens:,} tokens per KV head over all its layers")
        return lines


def _align(rows: Sequence[Sequence[str]], right_from: int) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def memory_report(plan: Any, geometry: Any = None, context_tokens: int = 4096, *, batch: int = 1,
                  dtype_bytes: int = 2, registry: Any = None, phase: str = "prefill",
                  num_heads: int | None = None, decode_slack: int | None = None,
                  new_tokens: int | None = None, head_counts: Any = None, allocations: Any = None) -> MemoryReport:
    """Nominal, resident and metadata bytes of ``plan`` per layer and in total (see :func:`predict_resident`,
    which takes the same arguments: ``head_counts`` and ``allocations`` from a session make ragged and
    allocated layers exact).

    >>> print(memory_report(plan, geometry, 16000).format_table())  # doctest: +SKIP
    """
    rows = predict_resident(plan, geometry, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                            registry=registry, phase=phase, num_heads=num_heads, decode_slack=decode_slack,
                            new_tokens=new_tokens, head_counts=head_counts, allocations=allocations)
    registry = registry if registry is not None else get_registry()
    groups, members, planned = [], [], {}
    for g in getattr(plan, "allocation", ()):
        caps = [plan.layers[i].prefill.kept_tokens(context_tokens) for i in g.layers]
        groups.append((g.describe(), int(registry.allocator(g.allocator)(**g.params).group_bound(caps, context_tokens))))
        members.append(tuple(g.layers))
        planned.update({i: {"budget": cap} for i, cap in zip(g.layers, caps)})
    expected = None
    if planned and allocations is None:
        at_budget = predict_resident(plan, geometry, context_tokens, batch=batch, dtype_bytes=dtype_bytes,
                                     registry=registry, phase=phase, num_heads=num_heads, decode_slack=decode_slack,
                                     new_tokens=new_tokens, head_counts=head_counts, allocations=planned)
        expected = sum(r.resident_bytes for r in at_budget)
    return MemoryReport(rows=rows, context_tokens=context_tokens, batch=batch, dtype_bytes=dtype_bytes, phase=phase,
                        group_bounds=groups, group_layers=members, bases_bytes=bases_bytes(plan, geometry, dtype_bytes),
                        expected_resident=expected)


def bases_bytes(plan: Any, geometry: Any, dtype_bytes: int) -> int:
    """Bytes of the basis slices a run of ``plan`` holds (:func:`polykv.models.kv_bases.bytes_of_bases`)."""
    geo = plan_geometry(plan, geometry)
    return bytes_of_bases([(lp.k_rank, lp.v_rank) for lp in plan.layers], num_kv_heads=int(geo.num_kv_heads),
                          head_dim=int(geo.head_dim), dtype_bytes=dtype_bytes)

