"""The second real model: Gemma 3 270M (15 sliding-window layers of 512 tokens, 3 full layers), by name.

One prompt of 1,000 tokens crosses the window; the keep-everything plan must reproduce vanilla
transformers there and over greedy decoding past it, while every sliding layer holds 511 tokens.
"""

from __future__ import annotations

import pytest
import torch

import polykv
from polykv.models.geometry import SLIDING, geometry_of_model
from polykv.models import load_model, model_geometry, named_model
from polykv.runtime.cache import cache_keyword, output_cache

pytestmark = pytest.mark.model
TOL = 1e-3   # float32 logits of magnitude ~50 over 18 layers and 1,000 tokens
PROMPT, STEPS, KEEP = 1000, 8, 16


@pytest.fixture(scope="module")
def gemma3():
    model, tokenizer = load_model("gemma3-270m")
    return model, tokenizer, geometry_of_model(model)


def test_loaded_by_name_with_its_window(gemma3):
    model, tokenizer, geo = gemma3
    assert named_model("gemma-3-270m").name == "gemma3-270m"
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (geo.num_layers, geo.num_kv_heads, geo.head_dim, geo.sliding_window) == (18, 1, 256, 512)
    assert [i for i, t in enumerate(geo.layer_types) if t != SLIDING] == [5, 11, 17]
    assert model_geometry("gemma3-270m").fingerprint.split("+")[0] == geo.fingerprint.split("+")[0]
    assert tokenizer.decode(tokenizer("The capital of France", add_special_tokens=False).input_ids) \
        == "The capital of France"


def test_full_plan_equals_vanilla_across_the_window(gemma3):
    model, _, geo = gemma3
    ids = torch.randint(10, 20000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, use_cache=True, logits_to_keep=KEEP)
        ref_logits, cache = [ref.logits], output_cache(ref)
        for _ in range(STEPS):
            out = model(ref_logits[-1][:, -1:].argmax(-1), **{cache_keyword(model): cache}, use_cache=True)
            ref_logits.append(out.logits)
        with polykv.apply(model, polykv.full_plan(geo)) as session:
            got = session.prefill(ids, logits_to_keep=KEEP)
            got_logits = [got.logits]
            for i in range(STEPS):
                tok = ref_logits[i][:, -1:].argmax(-1)
                got_logits.append(model(tok, **{cache_keyword(model): session.cache}, use_cache=True).logits)
            stored = session.cache.stored_tokens()
    diff = max((a - b).abs().max().item() for a, b in zip(got_logits, ref_logits))
    assert diff < TOL, diff
    assert [got_logits[i][:, -1].argmax().item() for i in range(STEPS + 1)] == \
        [ref_logits[i][:, -1].argmax().item() for i in range(STEPS + 1)]
    assert stored == [511 if t == SLIDING else PROMPT + STEPS for t in geo.layer_types]
