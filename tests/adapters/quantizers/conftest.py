"""Shared fixtures for quantizer tests: devices to run on, store and index factories."""

import pytest
import torch

from polykv.adapters.quantizers.kivi import KiviQuantizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device this machine has (CUDA too when present): the stores are device-agnostic."""
    return torch.device(request.param)


def _make_store(stream, bits, *, group_size=4, residual=8, dtype=torch.float32, device="cpu"):
    return KiviQuantizer(group_size=group_size, residual=residual).new_store(stream, bits, dtype=dtype, device=device)


def _random_index(B, H, T, k, *, shared=False, seed=0, device="cpu"):
    """[B, H, k] strictly ascending random survivors (one set for every head when ``shared``)."""
    g = torch.Generator().manual_seed(seed)
    if shared:
        return torch.randperm(T, generator=g)[:k].sort().values.expand(B, H, k).to(device)
    return torch.rand(B, H, T, generator=g).argsort(-1)[..., :k].sort(-1).values.to(device)


@pytest.fixture
def make_store():
    """``make_store(stream, bits, group_size=4, residual=8, dtype=float32, device="cpu")``."""
    return _make_store


@pytest.fixture
def random_index():
    """``random_index(B, H, T, k, shared=False, seed=0, device="cpu")``."""
    return _random_index


def _load_read_path_cases():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("read_path_cases.py")
    spec = importlib.util.spec_from_file_location("polykv_read_path_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def cases():
    """The read-path helpers (read_path_cases.py): filled store pairs, ragged counts, the dense oracle."""
    return _load_read_path_cases()
