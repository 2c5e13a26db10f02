"""Memory budgets and the nominal KV-bytes model the solvers optimise against.

A budget is stated at a context length ``T`` and given in one of three units:

* ``bytes``: a nominal KV-cache size in bytes;
* ``ratio``: a compression ratio against a full 16-bit cache (``8x`` = one eighth of its bytes);
* ``tokens_per_layer``: the average tokens a layer may keep at 16 bits (``256tok``).

Every budget converts to bytes with MoE-nD's nominal formula (arXiv 2604.17695), per layer

    m_l = keep_l * T * Hkv * d * (k_bits_l + v_bits_l) / 8

where ``keep_l * T`` is taken as the whole-token capacity the plan resolves to,
``max(1, ceil(keep * T))`` (exactly what :meth:`polykv.OpSpec.resolve_capacity` keeps). Scales,
zero points and full-precision residual blocks of a quantizer are metadata and are not counted
here; the runtime reports them separately. Internally the solvers count *bits* so that every
weight is an exact integer.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs

from polykv.errors import SolverError

KINDS = ("bytes", "ratio", "tokens_per_layer")
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


MAX_CONTEXT_TOKENS = 1 << 24
"""Largest context length a budget may refer to (16M tokens)."""
MAX_BUDGET_VALUE = 1e18
"""Largest budget value in any unit (an exabyte, or as many tokens): anything above is a typo."""


@attrs.define(frozen=True, kw_only=True)
class Budget:
    """A memory budget at a stated context length."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    """``"bytes"``, ``"ratio"`` or ``"tokens_per_layer"``."""
    value: float
    """Bytes, the compression ratio (>= 1), or average tokens per layer."""
    context_tokens: int
    """Context length T the budget and every prediction refer to."""

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
        if self.value > MAX_BUDGET_VALUE:
            raise SolverError(f"budget {self.kind} {self.value:g} is larger than any KV cache; give at most "
                              f"{MAX_BUDGET_VALUE:.0e} (e.g. 8x, 3MiB or 256tok)")
        if self.kind == "ratio" and self.value < 1:
            raise SolverError(f"a compression ratio below 1 ({self.value:g}x) asks for more than a full cache; "
                              "give a ratio >= 1, e.g. 8x")

    @classmethod
    def of_bytes(cls, n: int, context_tokens: int) -> "Budget":
        return cls(kind="bytes", value=int(n), context_tokens=context_tokens)

    @classmethod
    def of_ratio(cls, ratio: float, context_tokens: int) -> "Budget":
        return cls(kind="ratio", value=float(ratio), context_tokens=context_tokens)

    @classmethod
    def of_tokens(cls, tokens: int, context_tokens: int) -> "Budget":
        return cls(kind="tokens_per_layer", value=int(tokens), context_tokens=context_tokens)

    @classmethod
    def parse(cls, text: str, context_tokens: int) -> "Budget":
        """``"1048576"`` / ``"3MiB"`` (bytes), ``"8x"`` (ratio), ``"256tok"`` (tokens per layer)."""
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
            return cls.of_ratio(num, context_tokens)
        if unit in ("tok", "tokens"):
            if num != int(num):
                raise SolverError(f"tokens per layer must be a whole number, got {text!r}")
            return cls.of_tokens(int(num), context_tokens)
        n = num * _UNITS[unit]
        if n != int(n):
            raise SolverError(f"a byte budget must be a whole number of bytes, got {text!r}")
        return cls.of_bytes(int(n), context_tokens)

    def to_bytes(self, model: Any) -> int:
        """The budget in nominal bytes for ``model`` (anything with num_layers, num_kv_heads, head_dim)."""
        if self.kind == "bytes":
            return int(self.value)
        if self.kind == "ratio":
            return int(full_cache_bytes(model, self.context_tokens) // self.value)
        # 32 bits per K+V element pair: always a whole number of bytes.
        return int(model.num_layers) * int(self.value) * slot_bits(model, FULL_BITS, FULL_BITS) // 8

    def to_bits(self, model: Any) -> int:
        return 8 * self.to_bytes(model)

    def uniform_tokens(self, model: Any, k_bits: int = FULL_BITS, v_bits: int = FULL_BITS) -> int:
        """Largest token capacity every layer can hold at (k_bits, v_bits) within the budget."""
        return self.to_bits(model) // (int(model.num_layers) * slot_bits(model, k_bits, v_bits))

    def as_dict(self) -> dict[str, Any]:
        """The budget as given, for plan provenance (``{"ratio": 8.0}``, ...)."""
        return {self.kind: int(self.value) if self.kind != "ratio" else float(self.value)}

    def describe(self) -> str:
        if self.kind == "bytes":
            return f"{int(self.value)} bytes at T={self.context_tokens}"
        if self.kind == "ratio":
            return f"{self.value:g}x at T={self.context_tokens}"
        return f"{int(self.value)} tokens/layer at T={self.context_tokens}"
