"""cam: merged values equal a loop-by-loop computation of CaM's rule (Bernoulli mask replayed from the seed)."""

from __future__ import annotations

import pytest
import torch

from polykv.adapters.rules.cam import merge_values, merge_weights
from polykv.plan import validate_plan


def naive_cam(values, kept, acc, m, draws, divide_by):
    B, Hkv, T, d = values.shape
    out = []
    for b in range(B):
        heads = []
        for h in range(Hkv):
            ks = kept[b][h]
            new = {j: values[b, h, j].double().clone() for j in ks}
            for e in range(T):
                if e in ks:
                    continue
                window = [j for j in ks if j > e][:m]
                if not window:
                    continue
                mean = sum(float(acc[b, h, j]) for j in window) / len(window)
                a = float(acc[b, h, e])
                p = 0.0 if (a == 0 and mean == 0) else (1.0 if mean == 0 else min(max(a / mean, 0.0), 1.0))
                if float(draws[b, h, e]) < p:
                    div = len(window) if divide_by == "window" else m
                    for j in window:
                        new[j] += values[b, h, e].double() / div
            heads.append(torch.stack([new[j] for j in ks]))
        out.append(torch.stack(heads))
    return torch.stack(out)


@pytest.mark.parametrize("divide_by", ["window", "m"])
@pytest.mark.parametrize("T,C,m,seed", [(12, 5, 2, 0), (16, 6, 32, 1), (10, 9, 3, 2), (9, 1, 4, 3), (14, 7, 1, 4)])
def test_cam_merge_matches_definition(divide_by, T, C, m, seed):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, d = 2, 3, 4
    values = torch.randn(B, Hkv, T, d, generator=g)
    acc = torch.rand(B, Hkv, T, generator=g) * 3
    acc[0, 0, :3] = 0.0  # undefined ratios must not merge (0 / 0) or merge surely (x / 0)
    kept = torch.sort(torch.stack([torch.stack([torch.randperm(T, generator=g)[:C] for _ in range(Hkv)])
                                   for _ in range(B)]), dim=-1).values
    W = merge_weights(kept, acc, merge_window=m, generator=torch.Generator().manual_seed(99), divide_by=divide_by)
    got = merge_values(values, kept, W)
    draws = torch.rand(B, Hkv, T, generator=torch.Generator().manual_seed(99))
    want = naive_cam(values, kept.tolist(), acc, m, draws, divide_by)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_cam_merges_nothing_when_every_token_is_kept():
    acc = torch.rand(1, 2, 6)
    kept = torch.arange(6).view(1, 1, 6).expand(1, 2, 6)
    W = merge_weights(kept, acc, merge_window=2, generator=torch.Generator().manual_seed(0))
    assert not W.any()


@pytest.mark.parametrize("inner,params", [("streamingllm", {"n_sink": 2}), ("h2o", {}), ("tova", {})])
def test_cam_rule_keeps_the_inner_selection_and_merges_values(make_ctx, inner, params):
    from polykv.adapters.rules.cam import CaMRule
    from polykv.registry import get_registry

    ctx = make_ctx(B=2, H=4, Hkv=2, T=16, w=1, phase="decode")
    ctx.values = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(5))
    rule = CaMRule(rule=inner, rule_params=params, merge_window=3)
    state = rule.new_state()
    ctx.generator = torch.Generator().manual_seed(11)
    sel = rule.select(ctx, 6)
    plain = get_registry().rule(inner)(**params).select(ctx, 6)
    assert sel.index.tolist() == plain.expand(2, 2, 6).tolist()
    draws = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(11))
    want = naive_cam(ctx.values, sel.index.tolist(), ctx.accumulated, 3, draws, "window")
    merged, _ = sel.merge.apply(ctx.values)
    got = merged.gather(2, sel.index.unsqueeze(-1).expand(-1, -1, -1, 8))
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert sel.merge.streams == frozenset({"value"}) and state is not None


def test_cam_checks_its_parameters_when_built():
    from polykv.adapters.rules.cam import CaMRule

    for bad, match in [({"rule": "full"}, "another eviction rule"), ({"merge_window": 0}, "merge_window"),
                       ({"divide_by": "x"}, "divide_by"), ({"rule": "h2o", "rule_params": {"bogus": 1}}, "bogus")]:
        with pytest.raises(ValueError, match=match):
            CaMRule(**bad)
    assert CaMRule(rule="snapkv").phases == frozenset({"prefill"})


def test_a_plan_with_a_bad_inner_rule_fails_validation_naming_layer_and_field():
    import polykv
    from polykv.errors import PlanError
    from polykv.plan import OpSpec
    from polykv.registry import get_registry
    from polykv.testing import tiny_model
    from polykv.models.geometry import geometry_of_model

    geo = geometry_of_model(tiny_model("llama", layers=2))
    for params, needle, field in [
            ({"rule": "nope"}, "unknown inner rule", "params.rule"),
            ({"rule": "h2o", "rule_params": {"x": 1}}, "'x'", "params.rule_params"),
            ({"rule": "snapkv", "rule_params": {"window": 0}}, "window", "params.rule_params.window")]:
        plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="cam", capacity=8, params=params))
        with pytest.raises(PlanError, match=needle) as err:
            validate_plan(plan, registry=get_registry(), geometry=geo)
        assert f"field 'layers[0].prefill.{field}'" in str(err.value)


def test_cam_around_a_prefill_only_rule_is_refused_in_decode_when_the_plan_is_validated():
    """CaM runs where its inner rule runs; validation checks the built rule's phases, not the class's."""
    import polykv
    from polykv.errors import PlanError
    from polykv.plan import OpSpec
    from polykv.registry import get_registry
    from polykv.testing import tiny_model
    from polykv.models.geometry import geometry_of_model

    geo = geometry_of_model(tiny_model("llama", layers=2))
    plan = polykv.uniform_plan(geo, decode=OpSpec(rule="cam", capacity=8, params={"rule": "snapkv"}))
    with pytest.raises(PlanError, match="does not run in the decode phase") as err:
        validate_plan(plan, registry=get_registry(), geometry=geo)
    assert "field 'layers[0].decode.params'" in str(err.value)
    ok = polykv.uniform_plan(geo, decode=OpSpec(rule="cam", capacity=8, params={"rule": "h2o"}))
    validate_plan(ok, registry=get_registry(), geometry=geo)
