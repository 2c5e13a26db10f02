"""One plan runs PolyKV's nine methods plus TriAttention and Ada-KV on different layers.

The shipped plan for the default model validates and names every method; the same builder
(``bench/all_methods.py``) on a tiny 30-layer model prefills, allocates, merges and generates.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.adapters.rules.query_stats import compute_query_stats
from polykv.plan import validate_plan
from polykv.testing import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "examples" / "smollm2-all-methods.4x.plan.json"
NINE = {"h2o", "tova", "cam", "pyramidkv", "snapkv", "d2o", "cake", "scissorhands", "streamingllm"}


def _builder():
    spec = importlib.util.spec_from_file_location("all_methods", ROOT / "bench" / "all_methods.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.all_methods_plan


def test_shipped_plan_names_every_method_and_validates():
    plan = polykv.load_plan(str(SHIPPED))
    used = {lp.prefill.rule for lp in plan.layers} | {lp.decode.rule for lp in plan.layers}
    assert NINE | {"triattention", "adakv"} <= used
    assert {g.allocator for g in plan.allocation} == {"pyramidkv", "cake", "d2o"}
    from polykv.registry import get_registry

    validate_plan(plan, registry=get_registry())


def test_all_methods_run_together_on_a_tiny_model():
    model = tiny_model("llama", layers=30, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    plan = _builder()(geo, 4.0)
    g = torch.Generator().manual_seed(0)
    stats = compute_query_stats(model, [torch.randint(1, 128, (1, 64), generator=g)])
    ids = torch.randint(1, 128, (1, 160), generator=g)  # 4x keeps 40 > the 32-token window
    with torch.no_grad(), polykv.apply(model, plan, model_data={"triattention": stats}) as session:
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
        cache = session.cache
        assert out.shape == (1, 200)
        allocated = cache.allocations()
        assert sorted(allocated) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
        counts = cache.head_counts()
        assert len({n for row in counts[20] for n in row}) > 1  # the Ada-KV layer is ragged
        for i, lp in enumerate(plan.layers):  # decode capacity + slack honoured on every evicting layer
            if not lp.decode.keeps_everything and i not in allocated:
                assert cache.stored_tokens()[i] <= lp.decode.resolve_capacity(200) + plan.trigger.decode_slack
