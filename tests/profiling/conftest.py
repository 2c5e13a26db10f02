"""Fixtures of the calibration tests: a tiny random-weight Llama and seeded token sequences."""

from __future__ import annotations

import pytest
import torch

from polykv.profiling.calibrate_settings import CalibrationSettings
from polykv.testing import tiny_model

PREFIX = 64
TOKENS = 96
SMALL_RULES = ("h2o", "random", "streamingllm", "tova", "triattention")


@pytest.fixture(scope="module")
def model():
    """Tiny GQA Llama: 3 layers, 4 query heads, 2 KV heads, head_dim 32 (a multiple of kivi's group)."""
    return tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=32)


def _sequences(n: int = 2, length: int = TOKENS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (length,), generator=g) for _ in range(n)]


def _small_settings(**changes) -> CalibrationSettings:
    base = dict(rules=SMALL_RULES, keeps=(0.25, 0.5, 1.0), bits=(16, 8, 4), prefix=PREFIX, stat_capacity=16)
    base.update(changes)
    return CalibrationSettings(**base)


@pytest.fixture(scope="session")
def sequences():
    """``sequences(n=2, length=96, seed=0)``: seeded token ids in [1, 128), each [length]."""
    return _sequences


@pytest.fixture(scope="session")
def small_settings():
    """``small_settings(**changes)``: a reduced design space (prefix 64) that keeps each test file fast."""
    return _small_settings


@pytest.fixture(scope="session")
def prefix():
    return PREFIX
