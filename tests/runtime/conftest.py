"""Shared fixtures of the runtime tests: tiny random-weight models and prompts without pad tokens."""

from __future__ import annotations

import pytest
import torch

from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def llama():
    """Tiny GQA Llama (4 query heads, 2 KV heads) and its geometry."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    return model, geometry_of_model(model)


def make_prompt(batch: int, length: int, *, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """[batch, length] token ids in [1, vocab): id 0 is the tiny models' pad token."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g)


@pytest.fixture
def prompt():
    return make_prompt
