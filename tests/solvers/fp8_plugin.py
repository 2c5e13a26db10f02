"""A third-party fp8 quantizer, as a plugin author writes it from the docs: float8 (e4m3) codes with one
float32 scale per token and KV head, and a parameter declared with a ParamSpec.

Also a third-party allocator that declares its parameters, and a rule that declares none (the older
``defaults`` form), for the parameter checks of plan validation.
"""

from __future__ import annotations

import torch

import polykv
from polykv.contract.allocators import Allocator
from polykv.contract.rules import ScoredRule
from polykv.contract.stores import KVStore, Quantizer
from polykv.contract.params import ParamSpec

FP8 = torch.float8_e4m3fn


class Fp8Store(KVStore):
    """codes [B, Hkv, T, d] float8_e4m3fn (1 byte each), scales [B, Hkv, T, 1] float32."""

    def __init__(self, dtype: torch.dtype, device, max_code: float):
        self.dtype, self.device, self.max_code = dtype, device, max_code
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / self.max_code
        codes = (x.float() / scale).to(FP8)
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=2)
        self.scales = scale if self.scales is None else torch.cat([self.scales, scale], dim=2)

    def gather(self, index: torch.Tensor) -> None:
        d = self.codes.shape[-1]
        self.codes = self.codes.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, d))
        self.scales = self.scales.gather(2, index.unsqueeze(-1))

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scales).to(self.dtype)

    def __len__(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def resident_bytes(self) -> int:
        if self.codes is None:
            return 0
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


class Fp8Quantizer(Quantizer):
    """Per-token float8 (e4m3) codes with one float32 scale per token and KV head."""

    name = "test-fp8"
    bits = frozenset({8})
    param_specs = {"max_code": ParamSpec(float, default=448.0, low=1.0, high=448.0,
                                         description="largest code magnitude a scale maps to")}
    paper = "Micikevicius et al., FP8 Formats for Deep Learning, arXiv:2209.05433"

    def new_store(self, stream, bits, *, dtype, device):
        return Fp8Store(dtype, device, float(self.params["max_code"]))

    def predict_bytes(self, stream, bits, *, batch, kv_heads, head_dim, tokens, dtype_bytes):
        return batch * kv_heads * tokens * (head_dim + 4)         # 1-byte codes + a float32 scale per token


class MinTokensAllocator(Allocator):
    """Every group layer keeps its planned capacity, but at least ``min_tokens`` (a declared parameter)."""

    name = "test-min-tokens"
    param_specs = {"min_tokens": ParamSpec(int, default=4, low=1, high=1 << 20, description="smallest budget")}

    def layer_statistic(self, ctx):
        return None

    def allocate(self, request):
        caps = [request.capacities[request.group_layers.index(i)] for i in request.layers]
        return torch.tensor([max(c, int(self.params["min_tokens"])) for c in caps], dtype=torch.int64)


class SimilarityRule(ScoredRule):
    """Keeps the newest tokens; declares its parameter the older way (``defaults``, no spec)."""

    name = "test-unspecced"
    defaults = {"min_similarity": 0.5}

    def __init__(self, **params):
        super().__init__(**params)

    def score(self, ctx):
        if not isinstance(self.params["min_similarity"], float):
            raise ValueError("min_similarity must be a number")
        return torch.arange(ctx.num_stored, dtype=torch.float32).expand(ctx.keys.shape[0], ctx.num_kv_heads, -1)


class ThirdParty:
    @polykv.hookimpl
    def register_quantizers(self, register):
        register(Fp8Quantizer)

    @polykv.hookimpl
    def register_allocators(self, register):
        register(MinTokensAllocator)

    @polykv.hookimpl
    def register_operators(self, register):
        register(SimilarityRule)


PLUGIN_NAME = "test-third-party"


def registry_with_third_party():
    """A fresh registry with the built-ins and these plugins (no entry points)."""
    from polykv.registry import Registry

    registry = Registry(load_entry_points=False)
    registry.register_plugin(ThirdParty(), name=PLUGIN_NAME)
    return registry
