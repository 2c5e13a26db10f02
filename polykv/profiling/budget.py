"""Memory budgets and the two bytes models the solvers optimise against.

A budget is stated at a context length ``T`` and given in one of three units:

* ``bytes``: a KV-cache size in bytes;
* ``ratio``: a compression ratio against a full 16-bit cache (``8x`` = one eighth of its bytes,
  ``4 * L * Hkv * d * T`` bytes per batch row);
* ``tokens_per_layer``: the average tokens a layer may keep at 16 bits (``256tok``).

and counted on one of two bases (``basis``):

* ``resident``: the bytes the runtime really holds, per :mod:`polykv.memory`: codes, scales and
  minima, full-precision residual tokens, and metadata (positions, accumulated attention, query
  windows), the peak over phases, for ``batch`` rows with unquantized tensors, scales and residuals
  stored in ``cache_dtype``. A plan within an ``8x`` resident budget holds at most one eighth of the
  16-bit full cache, measured. ``polykv solve`` and studies use this basis by default.
* ``nominal``: MoE-nD's formula (arXiv 2604.17695), per layer

      m_l = keep_l * T * Hkv * d * (k_bits_l + v_bits_l) / 8

  where ``keep_l * T`` is the whole-token capacity the plan resolves to, ``max(1, ceil(keep * T))``
  (exactly what :meth:`polykv.OpSpec.resolve_capacity` keeps). Scales, zero points, residual blocks
  and metadata are not counted. This is the default of :class:`Budget` in Python, for MoE-nD
  comparisons.

Internally the solvers count *bits* (8 x bytes) so that every weight is an exact integer.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs

from polykv.errors import SolverError
from polykv.memory import kept_tokens, layer_held_bytes
from polykv.memory.budgets import pair_held_bytes
from polykv.plan import (BASES, BUDGET_KINDS, FULL_OP, MAX_BUDGET_VALUE, MAX_CONTEXT_TOKENS, STORAGE_DTYPE_BYTES,
                         LayerPlan)

CONTEXT_SLACK = 32
"""Resident costs of profiled configs hold for any context from T - 32 to T tokens (see Budget.layer_bits_bound)."""
_BOUND_CACHE: dict = {}
FULL_BITS = 16
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


def tokens_for_keep(keep: float, context_tokens: int) -> int:
    """Whole tokens a layer keeps at ``keep`` of a ``context_tokens`` context (``OpSpec`` rounding)."""
    if keep >= 1.0:
        return context_tokens
    return max(1, math.ceil(keep * context_tokens - 1e-9))


def slot_bits(model: Any, k_bits: int, v_bits: int) -> int:
    """Bits one token occupies in one layer: ``Hkv * d * (k_bits + v_bits)``."""
    return int(model.num_kv_heads) * int(model.head_dim) * (int(k_bits) + int(v_bits))


def layer_bits(model: Any, keep: float, k_bits: int, v_bits: int, context_tokens: int) -> int:
    """Nominal bits of one layer's K and V at ``keep`` of the context (the MoE-nD formula, x8)."""
    return tokens_for_keep(keep, context_tokens) * slot_bits(model, k_bits, v_bits)


def full_cache_bytes(model: Any, context_tokens: int) -> int:
    """Bytes of an uncompressed 16-bit K+V cache holding ``context_tokens`` in every layer."""
    return int(model.num_layers) * context_tokens * slot_bits(model, FULL_BITS, FULL_BITS) // 8


def bits_to_bytes(bits: int) -> int:
    return -(-int(bits) // 8)




@attrs.define(frozen=True, kw_only=True)
class Budget:
    """A memory budget at a stated context length."""

    kind: str = attrs.field(validator=attrs.validators.in_(BUDGET_KINDS))
    """``"bytes"``, ``"ratio"`` or ``"tokens_per_layer"``."""
    value: float
    """Bytes, the compression ratio (>= 1), or average tokens per layer."""
    context_tokens: int
    """Context length T the budget and every prediction refer to."""
    basis: str = attrs.field(default="nominal", validator=attrs.validators.in_(BASES))
    """``"resident"`` (real bytes, metadata included) or ``"nominal"`` (MoE-nD's codes-only formula)."""
    batch: int = 1
    """Batch rows the resident bytes are counted for (a ratio is against a full cache of as many rows)."""
    cache_dtype: str = attrs.field(default="bfloat16", validator=attrs.validators.in_(tuple(STORAGE_DTYPE_BYTES)))
    """Storage dtype of unquantized K/V, scales, minima and residuals (resident basis)."""

    def __attrs_post_init__(self):
        if isinstance(self.context_tokens, bool) or not isinstance(self.context_tokens, int) \
                or self.context_tokens < 1:
            raise SolverError(f"budget context length must be a positive integer, got {self.context_tokens!r} "
                              "(pass --context N with the number of context tokens)")
        if self.context_tokens > MAX_CONTEXT_TOKENS:
            raise SolverError(f"budget context length {self.context_tokens} is more than any model reads; use at "
                              f"most {MAX_CONTEXT_TOKENS} tokens")
        if not math.isfinite(self.value) or self.value <= 0:
            raise SolverError(f"budget {self.kind} must be a positive finite number, got {self.value!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise SolverError(f"budget batch must be a positive integer, got {self.batch!r}")
        if self.value > MAX_BUDGET_VALUE:
            raise SolverError(f"budget {self.kind} {self.value:g} is larger than any KV cache; give at most "
                              f"{MAX_BUDGET_VALUE:.0e} (e.g. 8x, 3MiB or 256tok)")
        if self.kind == "ratio" and self.value < 1:
            raise SolverError(f"a compression ratio below 1 ({self.value:g}x) asks for more than a full cache; "
                              "give a ratio >= 1, e.g. 8x")

    @classmethod
    def of_bytes(cls, n: int, context_tokens: int, **basis: Any) -> "Budget":
        return cls(kind="bytes", value=int(n), context_tokens=context_tokens, **basis)

    @classmethod
    def of_ratio(cls, ratio: float, context_tokens: int, **basis: Any) -> "Budget":
        return cls(kind="ratio", value=float(ratio), context_tokens=context_tokens, **basis)

    @classmethod
    def of_tokens(cls, tokens: int, context_tokens: int, **basis: Any) -> "Budget":
        return cls(kind="tokens_per_layer", value=int(tokens), context_tokens=context_tokens, **basis)

    @classmethod
    def parse(cls, text: str, context_tokens: int, **basis: Any) -> "Budget":
        """``"1048576"`` / ``"3MiB"`` (bytes), ``"8x"`` (ratio), ``"256tok"`` (tokens per layer).

        ``basis`` keywords: ``basis`` (``"resident"`` or ``"nominal"``), ``batch``, ``cache_dtype``.
        """
        s = str(text).strip().lower().replace("_", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(x|tok|tokens|[kmg]i?b|b)?", s)
        if not m:
            raise SolverError(f"cannot read budget {text!r}: use bytes (1048576 or 3MiB), a ratio (8x) "
                              "or tokens per layer (256tok)")
        num, unit = float(m.group(1)), m.group(2) or ""
        if not math.isfinite(num) or num > MAX_BUDGET_VALUE:
            raise SolverError(f"budget {text!r} is larger than any KV cache; give at most {MAX_BUDGET_VALUE:.0e} "
                              "(e.g. 8x, 3MiB or 256tok)")
        if unit == "x":
            return cls.of_ratio(num, context_tokens, **basis)
        if unit in ("tok", "tokens"):
            if num != int(num):
                raise SolverError(f"tokens per layer must be a whole number, got {text!r}")
            return cls.of_tokens(int(num), context_tokens, **basis)
        n = num * _UNITS[unit]
        if n != int(n):
            raise SolverError(f"a byte budget must be a whole number of bytes, got {text!r}")
        return cls.of_bytes(int(n), context_tokens, **basis)

    @property
    def resident(self) -> bool:
        return self.basis == "resident"

    @property
    def dtype_bytes(self) -> int:
        return STORAGE_DTYPE_BYTES[self.cache_dtype]

    def to_bytes(self, model: Any) -> int:
        """The budget in bytes of its basis for ``model`` (anything with num_layers, num_kv_heads, head_dim)."""
        if self.kind == "bytes":
            return int(self.value)
        rows = self.batch if self.resident else 1
        if self.kind == "ratio":
            return int(rows * full_cache_bytes(model, self.context_tokens) // self.value)
        return int(model.num_layers) * int(self.value) * self.token_bits(model) // 8

    def to_bits(self, model: Any) -> int:
        return 8 * self.to_bytes(model)

    def layer_bits(self, model: Any, layer: Any, registry: Any = None) -> int:
        """Bits one plan layer (a :class:`polykv.LayerPlan`) costs at T on this budget's basis.

        Nominal: ``kept * Hkv * d * (k_bits + v_bits)`` with ``kept`` the decode bound. Resident: 8 x
        :func:`polykv.memory.layer_held_bytes` (stores + metadata, peak over phases).
        """
        T = self.context_tokens
        if not self.resident:
            return kept_tokens(layer, T, "decode") * slot_bits(model, layer.k_bits, layer.v_bits)
        return 8 * layer_held_bytes(layer, model, T, batch=self.batch, dtype_bytes=self.dtype_bytes,
                                    registry=registry)

    def layer_bits_bound(self, model: Any, layer: Any, registry: Any = None) -> int:
        """:meth:`layer_bits`, charged at the largest share of the full cache the layer holds at any context
        from ``T - CONTEXT_SLACK`` to ``T`` (scaled to T); nominal: :meth:`layer_bits`.

        Ratio capacities resolve to whole tokens and a quantizer keeps its newest tokens in full precision
        until a block fills, so a layer's share of the cache moves with the exact context length; a
        context a little shorter than T (a prompt's real length) must not hold more than the budget.
        """
        if not self.resident:
            return self.layer_bits(model, layer, registry)
        T = self.context_tokens
        pre = layer.prefill  # a prefill rule's identity costs nothing: only what it keeps
        key = ((pre.keeps_everything, pre.capacity, pre.capacity_ratio), repr(layer.decode), layer.k_bits,
               layer.v_bits, layer.k_rank, layer.v_rank, layer.quantizer, repr(sorted(layer.quantizer_params.items())),
               int(model.num_kv_heads), int(model.head_dim), getattr(model, "num_heads", None), T, self.batch, self.dtype_bytes, id(registry))
        if key not in _BOUND_CACHE:
            worst = 0
            for t in range(max(1, T - CONTEXT_SLACK), T + 1):
                held = layer_held_bytes(layer, model, t, batch=self.batch, dtype_bytes=self.dtype_bytes,
                                        registry=registry)
                worst = max(worst, -(-8 * held * T // t))
            if len(_BOUND_CACHE) > 100_000:
                _BOUND_CACHE.clear()
            _BOUND_CACHE[key] = worst
        return _BOUND_CACHE[key]

    def pair_bits(self, model: Any, share_params: Any = None, registry: Any = None, *, bound: bool = True) -> int:
        """Bits of a shared layer pair (``LayerPlan.share``: both layers keep every token at 16 bits), both layers
        together, at T on this budget's basis. Resident: what :func:`polykv.memory.held_bytes_per_layer` counts for
        the pair (merged directions, magnitudes, retained tokens, indices), charged like :meth:`layer_bits_bound`
        at its largest share of the full cache from ``T - CONTEXT_SLACK`` to ``T`` (``bound=False``: at T exactly).
        Nominal: the nominal model counts no sharing, two full 16-bit layers."""
        lower = LayerPlan(layer=0)
        if not self.resident:
            return 2 * self.layer_bits(model, lower, registry)
        T = self.context_tokens
        if not bound:
            return 8 * pair_held_bytes(model, T, share_params, batch=self.batch, dtype_bytes=self.dtype_bytes,
                                       registry=registry)
        key = ("pair", repr(sorted(dict(share_params or {}).items())), int(model.num_kv_heads), int(model.head_dim),
               getattr(model, "num_heads", None), T, self.batch, self.dtype_bytes, id(registry))
        if key not in _BOUND_CACHE:
            _BOUND_CACHE[key] = max(-(-8 * pair_held_bytes(model, t, share_params, batch=self.batch,
                                                           dtype_bytes=self.dtype_bytes, registry=registry) * T // t)
                                    for t in range(max(1, T - CONTEXT_SLACK), T + 1))
        return _BOUND_CACHE[key]

    def plan_bits(self, model: Any, layers: Any, registry: Any = None) -> int:
        """Bits of the plan layers ``layers`` (a list of :class:`polykv.LayerPlan`) at T on this basis: each unshared
        layer's :meth:`layer_bits`, each shared pair's :meth:`pair_bits`."""
        layers = list(layers)
        paired = {lp.share for lp in layers if lp.share is not None} | {lp.layer for lp in layers
                                                                        if lp.share is not None}
        return (sum(self.layer_bits(model, lp, registry) for lp in layers if lp.layer not in paired)
                + sum(self.pair_bits(model, lp.share_params, registry, bound=False) for lp in layers
                      if lp.share is not None))

    def token_bits(self, model: Any) -> int:
        """Bits one 16-bit token costs in one layer (nominal: ``32 * Hkv * d``; resident: K, V and its position)."""
        if not self.resident:
            return slot_bits(model, FULL_BITS, FULL_BITS)
        return 8 * layer_held_bytes(LayerPlan(layer=0), model, 1, batch=self.batch, dtype_bytes=self.dtype_bytes)

    def uniform_tokens(self, model: Any, k_bits: int = FULL_BITS, v_bits: int = FULL_BITS, *,
                       layer: Any = None, registry: Any = None) -> int:
        """Largest token capacity every layer can hold at (k_bits, v_bits) within the budget (at most T
        on the resident basis). ``layer``: the plan layer whose op capacity is varied (resident basis;
        default a layer that holds the tokens and no rule state)."""
        L = int(model.num_layers)
        if not self.resident:
            return self.to_bits(model) // (L * slot_bits(model, k_bits, v_bits))
        per_layer = self.to_bits(model) // L
        if layer is None and k_bits == v_bits == FULL_BITS:
            return min(per_layer // self.token_bits(model), self.context_tokens)
        return tokens_that_fit(lambda t: self.capacity_bits(model, layer, t, k_bits, v_bits, registry),
                               per_layer, self.context_tokens)

    def capacity_bits(self, model: Any, layer: Any, tokens: int, k_bits: int, v_bits: int, registry: Any = None) -> int:
        """Bits of ``layer`` with its rule ops set to keep ``tokens`` tokens, at (k_bits, v_bits).

        ``layer`` None (or a layer without rules): a layer that holds ``tokens`` tokens and no rule state
        (with ``layer``'s quantizer when given).
        """
        T = self.context_tokens
        if layer is None or (layer.prefill.keeps_everything and layer.decode.keeps_everything):
            shorter = attrs.evolve(self, context_tokens=max(1, min(int(tokens), T)))
            held = LayerPlan(layer=0) if layer is None else LayerPlan(layer=0, quantizer=layer.quantizer,
                                                                      quantizer_params=layer.quantizer_params)
            return shorter.layer_bits(model, attrs.evolve(held, k_bits=k_bits, v_bits=v_bits), registry)
        ops = {}
        for phase in ("prefill", "decode"):
            op = getattr(layer, phase)
            if not op.keeps_everything:
                op = FULL_OP if tokens >= T else attrs.evolve(op, capacity=int(tokens), capacity_ratio=None)
            ops[phase] = op
        return self.layer_bits(model, attrs.evolve(layer, k_bits=k_bits, v_bits=v_bits, **ops), registry)

    def as_dict(self) -> dict[str, Any]:
        """The budget as given, for plan provenance (``{"ratio": 8.0}``, ...)."""
        return {self.kind: int(self.value) if self.kind != "ratio" else float(self.value)}

    def describe(self) -> str:
        if self.kind == "bytes":
            what = f"{int(self.value)} bytes"
        elif self.kind == "ratio":
            what = f"{self.value:g}x"
        else:
            what = f"{int(self.value)} tokens/layer"
        extra = f", batch {self.batch}, {self.cache_dtype}" if self.resident else ""
        return f"{what} {self.basis} at T={self.context_tokens}{extra}"


def tokens_that_fit(cost: Any, limit: int, context_tokens: int) -> int:
    """Largest ``t`` in [0, T] such that every capacity up to ``t`` fits: ``cost(t') <= limit`` for all t' <= t.

    A quantizer's cost can dip as ``t`` grows (its full-precision residual block empties when it
    fills), and a capacity chosen right after a dip would hold more than the budget on a slightly
    shorter context; requiring every smaller capacity to fit rules that out. ``cost`` is assumed to
    rise by less than one residual block's worth between dips, so the binary search on ``cost`` is
    followed by a check of the 64 capacities below the answer.
    """
    lo, hi = 0, int(context_tokens)
    if cost(hi) <= limit and all(cost(t) <= limit for t in range(max(1, hi - 64), hi)):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= limit:
            lo = mid
        else:
            hi = mid
    while lo > 0 and any(cost(t) > limit for t in range(max(1, lo - 64), lo)):
        lo = min(t for t in range(max(1, lo - 64), lo) if cost(t) > limit) - 1
    return lo
