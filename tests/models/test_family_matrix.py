"""The family matrix: every causal-LM family of the installed transformers, tiny, under polykv.

Each family is served exactly (full plan == vanilla, compressed plan == masked full-cache reference),
or refused with one line naming the model type and the reason; never a traceback and never a silently
different output. See :mod:`polykv.models.families` (``python scripts/family_table.py`` prints the table).
"""

from __future__ import annotations

import pytest

from polykv.models.families import TOL, check_family, falcon_computes_attention_itself, model_types

MUST_SERVE = {
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "olmo3",
    "exaone4", "llama4_text", "gpt2", "gptj", "gpt_neox", "opt", "persimmon", "codegen", "phi", "starcoder2",
}
"""Families the runtime must serve: sliding and hybrid layers, softcap, sinks, chunks, multi-head."""
MUST_REFUSE = {"deepseek_v2", "deepseek_v3", "minicpm3", "diffllama", "falcon_h1", "bloom", "gemma4_text"} | \
    ({"falcon"} if falcon_computes_attention_itself() else set())
"""Families that must be refused before anything is patched (Falcon while its attention bypasses transformers'
attention interface, as it does up to transformers 5.24; from 5.25 it dispatches through it and is served)."""
STARTS_A_PROCESS = {"rwkv": "building the model runs `ninja --version` to look for a compiler of its CUDA kernel"}
"""Families whose tiny model starts a process while it is built: slow tests (see tests/conftest.py)."""


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.slow) if t in STARTS_A_PROCESS else t
                                        for t in model_types()])
def test_family(model_type):
    r = check_family(model_type)
    if r.status == "served":
        assert model_type not in MUST_REFUSE
        assert r.full_diff < TOL, f"{model_type}: full plan differs from vanilla by {r.full_diff:.2e}"
        assert r.masked_diff < TOL, f"{model_type}: compressed plan differs from the masked reference by " \
                                    f"{r.masked_diff:.2e}"
    elif r.status == "refused":
        assert model_type not in MUST_SERVE, r.message
        assert "\n" not in r.message
        if model_type in MUST_REFUSE:
            assert not r.message.startswith("at the first forward")
            assert f"model type '{model_type}' cannot be served by polykv: " in r.message
    else:
        assert r.status in ("not a decoder", "not built"), f"{model_type}: {r.status}: {r.message}"
        assert model_type not in MUST_SERVE | MUST_REFUSE, f"{model_type}: {r.status}: {r.message}"
