"""Bad settings of the compiled CPU decode kernel over KIVI codes, through the Python API: a switch that is not
one is refused in one line naming the variable; a kernel that cannot be built (no compiler, a failing one, a
cache folder that cannot be written) says why in one warning line, once, and decode goes on blockwise with the
same tokens as with the kernel switched off."""

from __future__ import annotations

import warnings

import pytest
import torch

import polykv
from polykv.adapters.quantizers import kivi_cpu
from polykv.contract import model_data
from polykv.errors import PolykvError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96)


def _tokens(model, steps: int = 6) -> list[int]:
    plan = polykv.uniform_plan(geometry_of_model(model), k_bits=4, v_bits=4,
                               quantizer_params={"group_size": 8, "residual": 8})
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    out = []
    with torch.no_grad(), polykv.apply(model, plan) as session:
        logits = session.prefill(ids).logits
        for _ in range(steps):
            tok = logits[:, -1:].argmax(-1)
            out.append(int(tok))
            logits = model(tok, use_cache=True, **{session.cache_keyword: session.cache}).logits
    return out


@pytest.mark.parametrize("value", ["maybe", "2", "enable", " "])
def test_a_switch_that_is_not_one_is_refused_naming_the_variable(model, monkeypatch, value):
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, value)
    with pytest.raises(RuntimeConfigError) as err:
        _tokens(model)
    msg = str(err.value)
    assert "\n" not in msg and kivi_cpu.ENV_SWITCH in msg and repr(value) in msg and "0" in msg


@pytest.mark.parametrize("value", ["0", "off", " OFF ", "false", "no"])
def test_the_switch_off_reads_blockwise_without_a_word(model, monkeypatch, value):
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, value)
    calls = []
    real = kivi_cpu.decode_attention
    monkeypatch.setattr(kivi_cpu, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", kivi_cpu.KernelUnavailableWarning)
        _tokens(model)
    assert not calls


def _unbuildable(monkeypatch, tmp_path, how: str) -> str:
    """Make the next build fail in the way ``how``; returns what the warning line must name."""
    monkeypatch.setattr(kivi_cpu, "_state", {})
    if how == "no-compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        return "no-such-cc"
    if how == "failing-compiler":
        monkeypatch.setenv("CC", "false")
        return "false failed"
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setattr(model_data, "cache_dir", lambda: str(blocker / "model-data"))
    return "not-a-folder"


@pytest.mark.parametrize("how", ["no-compiler", pytest.param("failing-compiler", marks=pytest.mark.slow),  # runs it
                                 "cache-unwritable"])
def test_a_kernel_that_cannot_be_built_says_why_once_and_decode_goes_on(model, monkeypatch, tmp_path, how):
    names = _unbuildable(monkeypatch, tmp_path, how)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _tokens(model)
    notes = [str(w.message) for w in seen if issubclass(w.category, kivi_cpu.KernelUnavailableWarning)]
    assert len(notes) == 1 and "\n" not in notes[0] and names in notes[0], notes
    assert "blockwise" in notes[0] and kivi_cpu.ENV_SWITCH in notes[0]
    monkeypatch.setenv(kivi_cpu.ENV_SWITCH, "0")
    assert got == _tokens(model)


def test_the_kernel_refuses_queries_of_another_head_dim(monkeypatch):
    from polykv.adapters.quantizers.kivi import KiviQuantizer
    from polykv.attention.online_softmax import token_blocks

    stores = [KiviQuantizer(group_size=4, residual=8).new_store(s, 4, dtype=torch.float32, device="cpu")
              for s in ("key", "value")]
    for s in stores:
        s.append(torch.randn(1, 2, 20, 16))
    with pytest.raises(ValueError) as err:
        kivi_cpu.decode_attention(torch.randn(1, 4, 1, 8), *map(token_blocks, stores), scaling=0.25)
    assert "\n" not in str(err.value) and "head dim 8" in str(err.value) and "16" in str(err.value)
    assert not isinstance(err.value, PolykvError)  # a programming error of the caller, as in the blockwise path
