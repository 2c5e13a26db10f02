"""Models the runtime cannot serve are refused by polykv.apply before anything is patched, in one line."""

from __future__ import annotations

import pytest

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.families import build, falcon_computes_attention_itself
from polykv.models.geometry import geometry_from_config

CASES = {
    "deepseek_v3": "multi-head latent attention",
    "minicpm3": "multi-head latent attention",
    "diffllama": "differential attention",
    "falcon_h1": "state that is not a per-head K/V cache",
    "jamba": "state that is not a per-head K/V cache",
    "bloom": "computes attention itself",
    "gemma4_text": "reuse another layer's keys and values",
    "bert": "bidirectional",
}
if falcon_computes_attention_itself():   # up to transformers 5.24; from 5.25 Falcon is served (the family matrix)
    CASES["falcon"] = "computes attention itself"


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_refused_before_anything_is_patched(model_type):
    model, why = build(model_type)
    if model is None:
        model, why = build(model_type, device="meta")
    assert model is not None, why
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeConfigError) as err:
        polykv.apply(model, polykv.full_plan(geometry_from_config(model.config)) if model_type != "gemma4_text"
                     else None)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model type '{model_type}' cannot be served by polykv: ")
    assert CASES[model_type] in message
    assert "supported are decoders whose every layer is softmax attention" in message
    assert "session.new_cache" not in message
    assert model.config._attn_implementation == impl and "generate" not in model.__dict__
