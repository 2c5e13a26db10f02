"""Every shipped plan runs on the model as the user loaded it: SmolLM2-135M and Gemma 3 270M in float32, bfloat16
and float16, and SmolLM2 cast with ``model.to(torch.bfloat16)`` after loading (which rounds its RoPE frequency
buffer to bfloat16: plans with TriAttention's query statistics must still run). Gemma 3 overflows in float16
without polykv too (non-finite activations from layer 8 on); there every plan must be refused in one line
that names the overflow and the dtypes to load instead, not blame a rule.

Each model is loaded once per dtype; every plan made for it (by file name, checked against the model's
fingerprint) is applied and generates a few greedy tokens from a short prompt.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import polykv
import polykv.errors
from polykv.models import load_model
from polykv.models.geometry import fingerprints_match, geometry_of_model

pytestmark = pytest.mark.model

PLANS = Path(__file__).resolve().parents[2] / "plans"
PREFIX = {"smollm2-135m": "smollm2-135m-instruct.", "gemma3-270m": "gemma3-270m."}
PROMPT, NEW_TOKENS = "The capital of France is", 3
VARIANTS = [("smollm2-135m", torch.float32, False), ("smollm2-135m", torch.bfloat16, False),
            ("smollm2-135m", torch.float16, False), ("smollm2-135m", torch.bfloat16, True),
            ("gemma3-270m", torch.float32, False), ("gemma3-270m", torch.bfloat16, False),
            ("gemma3-270m", torch.float16, False)]


def plans_of(name: str) -> list[Path]:
    return sorted(p for p in PLANS.glob("*.plan.json") if p.name.startswith(PREFIX[name]))


def test_every_shipped_plan_belongs_to_one_of_the_two_models():
    assert sorted(p for name in PREFIX for p in plans_of(name)) == sorted(PLANS.glob("*.plan.json"))
    assert plans_of("smollm2-135m") and plans_of("gemma3-270m")


@pytest.mark.parametrize("name,dtype,cast", VARIANTS,
                         ids=[f"{n}-{str(d).removeprefix('torch.')}{'-cast' if c else ''}" for n, d, c in VARIANTS])
def test_every_shipped_plan_runs_in_this_dtype(name, dtype, cast):
    model, tokenizer = load_model(name, dtype=torch.float32 if cast else dtype)
    if cast:
        model = model.to(dtype)
    assert next(model.parameters()).dtype == dtype
    geo = geometry_of_model(model)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        overflows = not bool(model(ids).logits.isfinite().all())
    # Gemma 3 overflows in float16 without polykv too: then every plan is refused in one line that says so
    assert not overflows or (name, dtype) == ("gemma3-270m", torch.float16)
    failed = {}
    for path in plans_of(name):
        plan = polykv.load_plan(str(path))
        assert fingerprints_match(plan.model.fingerprint, geo.fingerprint), path.name
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")   # capacities budgeted for another context length
                with polykv.apply(model, plan):
                    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False)
            assert out.shape == (1, ids.shape[1] + NEW_TOKENS) and not overflows
        except Exception as exc:  # noqa: BLE001 - collect every plan that fails, with its one line
            if not (overflows and isinstance(exc, polykv.errors.RuntimeConfigError) and "overflows in" in str(exc)
                    and "\n" not in str(exc)):
                failed[path.name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    assert not failed, failed
