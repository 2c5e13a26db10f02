"""d2o: layer statistic, layer budgets, threshold and merge equal a loop-by-loop computation."""

from __future__ import annotations

import math

import pytest
import torch

from polykv.adapters.rules.d2o import layer_budgets, layer_score, merge_matrix, nearest_kept, update_threshold


def naive_layer_score(c):
    B, H, T = len(c), len(c[0]), len(c[0][0])
    v = []
    for h in range(H):
        per_b = []
        for b in range(B):
            xs = c[b][h]
            m = sum(xs) / T
            per_b.append(sum((x - m) ** 2 for x in xs) / (T - 1))
        v.append(sum(per_b) / B)
    lo, hi = min(v), max(v)
    return sum((x - lo) / (hi - lo + 1e-6) for x in v) / H


def test_layer_score_matches_definition():
    c = torch.rand(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    assert layer_score(c) == pytest.approx(naive_layer_score(c.tolist()), rel=1e-12)


@pytest.mark.parametrize("scores,T,total", [
    ([0.1, 0.5, 0.9, 0.3], 100, 4 * 25), ([0.0] * 5, 64, 5 * 16), ([0.9, 0.1], 50, 2 * 40),
    ([0.2, 0.8, 0.5, 0.4, 0.6, 0.1], 2048, 6 * 256),
])
def test_layer_budgets_match_definition(scores, T, total):
    L = len(scores)
    rho = total / (L * T)
    z = sum(math.exp(-s) for s in scores)
    r = [min(1.0, max(0.01, L * rho * math.exp(-s) / z)) for s in scores]
    want = [max(1, min(T, math.floor(T * x + 1e-9))) for x in r]
    while sum(want) > total:
        big = max(want)
        want[want.index(big)] -= 1
    got = layer_budgets(scores, T, total)
    assert got == want and sum(got) <= total


def naive_merge(keys, kept, tau, variant, c=0.1):
    """New kept rows per (b, h) by loops: nearest kept key by cosine, gate, weighted merge."""
    B, Hkv, T, d = keys.shape
    out = torch.zeros(B, Hkv, len(kept[0][0]), d, dtype=torch.float64)
    sims = []
    for b in range(B):
        for h in range(Hkv):
            ks = kept[b][h]
            num = {j: keys[b, h, j].double() * (1.0 if variant == "code" else c) for j in ks}
            den = {j: (1.0 if variant == "code" else c) for j in ks}
            for e in range(T):
                if e in ks:
                    continue
                ke = keys[b, h, e].double()
                best, arg = -2.0, None
                for j in ks:
                    kj = keys[b, h, j].double()
                    s = float(ke @ kj / (ke.norm() * kj.norm()))
                    if s > best + 1e-12:
                        best, arg = s, j
                sims.append(best)
                if best >= tau:
                    w = best if variant == "code" else math.exp(best)
                    num[arg] = num[arg] + w * ke
                    den[arg] += 1.0 if variant == "code" else w
            for slot, j in enumerate(ks):
                out[b, h, slot] = num[j] / den[j]
    return out, sims


@pytest.mark.parametrize("variant", ["code", "paper"])
@pytest.mark.parametrize("tau", [-1.0, 0.2, 0.5])
def test_merge_matches_definition(variant, tau):
    g = torch.Generator().manual_seed(1)
    B, Hkv, T, d, C = 2, 2, 12, 4, 5
    keys = torch.randn(B, Hkv, T, d, generator=g)
    kept = torch.sort(torch.stack([torch.stack([torch.randperm(T, generator=g)[:C] for _ in range(Hkv)])
                                   for _ in range(B)]), dim=-1).values
    slot, sim, evicted = nearest_kept(keys, kept)
    M = merge_matrix(kept, slot, sim, evicted, tau, variant=variant)
    got = torch.matmul(M, keys.double())
    want, sims = naive_merge(keys, kept.tolist(), tau, variant)
    assert torch.allclose(got, want, atol=1e-5)
    assert sorted(sim[evicted].tolist()) == pytest.approx(sorted(sims), abs=1e-5)


def test_threshold_ema():
    s1, s2 = torch.tensor([0.2, 0.4]), torch.tensor([0.9, 0.1, 0.5])
    tau = update_threshold(None, s1)
    assert tau == pytest.approx(0.3)
    assert update_threshold(tau, s2) == pytest.approx(0.5 * 0.3 + 0.5 * 0.5)
    tau = update_threshold(None, s1, variant="paper", beta=0.7)
    assert tau == pytest.approx(0.4)
    assert update_threshold(tau, s2, variant="paper", beta=0.7) == pytest.approx(0.7 * 0.9 + 0.3 * 0.4)
    assert update_threshold(0.25, torch.tensor([])) == 0.25


@pytest.mark.parametrize("variant", ["code", "paper"])
def test_d2o_rule_merge_applied_equals_the_matrix_form(make_ctx, variant):
    from polykv.adapters.rules.d2o import D2ORule, MergeThreshold
    from polykv.contract.state import AccumulatedAttention

    ctx = make_ctx(B=2, H=4, Hkv=2, T=14, w=2, phase="decode")
    rule = D2ORule(variant=variant, n_sink=2)
    ctx.state = rule.new_state()
    state = ctx.state.component(MergeThreshold)
    sel = rule.select(ctx, 7)
    kept = sel.index
    # H2O with 2 sinks and floor(0.5 * 7) = 3 recent tokens: a loop-by-loop top-k of the rest.
    for b in range(2):
        for h in range(2):
            acc = ctx.accumulated[b, h].tolist()
            rest = sorted(range(2, 11), key=lambda j: (-acc[j], j))[:2]
            assert kept[b, h].tolist() == sorted([0, 1] + rest + [11, 12, 13])
    # one threshold per batch row, from that row's evicted tokens only
    assert len(state.tau) == 2
    for b in range(2):
        want_keys, sims = naive_merge(ctx.keys[b:b + 1], kept[b:b + 1].tolist(), state.tau[b], variant)
        tau0 = (sum(sims) / len(sims)) if variant == "code" else max(sims)
        assert state.tau[b] == pytest.approx(tau0, abs=1e-6)
        for stream, x in (("key", ctx.keys), ("value", ctx.keys)):
            merged, _ = sel.merge.apply(x)
            got = merged[b:b + 1].gather(2, kept[b:b + 1].unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
            assert torch.allclose(got.double(), want_keys, atol=1e-5), stream
    assert sel.merge.streams == frozenset({"key", "value"})
    assert ctx.state.component(AccumulatedAttention) is not None


def test_d2o_allocator_statistic_uses_per_head_column_sums_of_every_prompt_row(make_ctx, attn_row):
    from polykv.adapters.rules.d2o import D2OAllocator
    from polykv.contract.state import Observation

    ctx = make_ctx(B=1, H=4, Hkv=2, T=10, w=10)  # every stored token is a prompt query
    alloc = D2OAllocator()
    state = alloc.new_state()
    state.observe(Observation(layer_idx=0, phase="prefill", query=ctx.queries, keys=ctx.keys, positions=ctx.positions,
                              valid=None, first_position=0, scaling=ctx.scaling))
    want = [[[sum(attn_row(ctx, 0, h, i)[j] for i in range(10)) for j in range(10)] for h in range(4)]]
    assert torch.allclose(state.sums.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    ctx.state = state
    assert alloc.layer_statistic(ctx) == pytest.approx(naive_layer_score(want), rel=1e-5)


def _d2o_plan(geo, *, allocator: bool = False):
    import attrs

    import polykv
    from polykv.plan import AllocationGroup

    plan = polykv.uniform_plan(geo, prefill="d2o", decode="d2o", capacity=8, params={"n_sink": 2}, decode_slack=1)
    if allocator:
        plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator="d2o", layers=tuple(range(geo.num_layers))),))
    return plan


def _generate(model, plan, ids, steps=10):
    import polykv

    with torch.no_grad(), polykv.apply(model, plan):
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, dim=1)                    # (B, T + steps), (B, steps, V)


@pytest.mark.parametrize("variant", ["code", "paper"])
def test_d2o_rows_of_a_batch_equal_each_row_alone(variant):
    """Every eviction updates each row's merge threshold from that row's tokens: a batch of equal-length
    rows generates what each row generates alone (tokens exactly, logits to float tolerance)."""
    import attrs

    from polykv.models.geometry import geometry_of_model
    from polykv.testing import tiny_model, token_ids

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    plan = _d2o_plan(geo)
    plan = attrs.evolve(plan, layers=[attrs.evolve(lp, prefill=attrs.evolve(lp.prefill, params={
        **lp.prefill.params, "variant": variant}), decode=attrs.evolve(lp.decode, params={
            **lp.decode.params, "variant": variant})) for lp in plan.layers])
    ids = torch.cat([token_ids(1, 24, seed=1), token_ids(1, 24, seed=2)])
    both, both_scores = _generate(model, plan, ids)
    for b in range(2):
        alone, alone_scores = _generate(model, plan, ids[b:b + 1])
        assert torch.equal(both[b:b + 1], alone)
        assert (both_scores[b] - alone_scores[0]).abs().max() < 1e-4


def test_the_d2o_allocator_refuses_a_batch_of_several_rows():
    """Its layer budgets come from the statistics of the whole prompt batch (one budget per layer for every
    row), so rows would change each other's budgets: refused in one line; one row at a time runs."""
    import polykv
    from polykv.errors import RuntimeConfigError
    from polykv.models.geometry import geometry_of_model
    from polykv.testing import tiny_model, token_ids

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    plan = _d2o_plan(geometry_of_model(model), allocator=True)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        with pytest.raises(RuntimeConfigError) as info:
            session.prefill(token_ids(2, 24))
        session.prefill(token_ids(1, 24))
        assert sum(a["budget"] for a in session.allocations().values()) <= 16
    text = str(info.value)
    assert "allocator 'd2o'" in text and "batch of 2" in text and "one prompt at a time" in text and "\n" not in text


def test_d2o_refuses_per_head_budgets_instead_of_keeping_padding(make_ctx):
    """Per-head budgets make the inner top-k ragged; D2O's one kept set per row cannot hold that."""
    from polykv.adapters.rules.d2o import D2ORule

    ctx = make_ctx(B=1, H=4, Hkv=2, T=14, w=2, phase="decode")
    rule = D2ORule(n_sink=2)
    ctx.state = rule.new_state()
    ctx.head_capacity = torch.tensor([[4, 9]])
    with pytest.raises(ValueError, match="layer .*rule 'd2o'.*per-head budgets"):
        rule.select(ctx, 9)
