"""cake: preference, indicator, budget split and selection equal a loop-by-loop computation."""

from __future__ import annotations

import math

import pytest
import torch

from polykv.adapters.rules.cake import CAKEAllocator, CAKERule, split_budgets
from polykv.contract.state import QueryWindow
from polykv.plan import validate_plan


def naive_rows(ctx, attn_row, b, h, rows):
    nq = ctx.queries.shape[2]
    return [attn_row(ctx, b, h, i) for i in range(nq - rows, nq)]


def naive_var(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def naive_preference(ctx, attn_row, w, tau1, tau2):
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    ent = var = 0.0
    for b in range(B):
        for h in range(H):
            rows = naive_rows(ctx, attn_row, b, h, w)
            for j in range(T - w):
                col = [r[j] for r in rows]
                ent -= sum(a * math.log(a + 1e-10) for a in col)
                var += naive_var(col)
    return ent ** (1 / tau1) * var ** (1 / tau2)


def naive_cake(ctx, attn_row, top, capacity, w, gamma, kernel, phase):
    B, Hkv, T = ctx.keys.shape[:3]
    H = ctx.queries.shape[1]
    G = H // Hkv
    out = []
    for b in range(B):
        heads = []
        for kv in range(Hkv):
            if capacity <= w:
                heads.append(list(range(T - capacity, T)))
                continue
            n = T - w
            ind = [0.0] * n
            for g in range(G):
                rows = naive_rows(ctx, attn_row, b, kv * G + g, 1 if phase == "decode" else w)
                raw = []
                for j in range(n):
                    col = [r[j] for r in rows]
                    v = sum(col) / len(col)
                    if len(col) > 1:
                        v += gamma * naive_var(col)
                    raw.append(v)
                for j in range(n):  # zero-padded average pool, padding counted
                    window = [raw[x] if 0 <= x < n else 0.0 for x in range(j - kernel // 2, j + kernel // 2 + 1)]
                    ind[j] += sum(window) / kernel / G
            heads.append(sorted(top(ind, capacity - w) + list(range(n, T))))
        out.append(heads)
    return out


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("capacity,w,gamma,kernel,gaps", [
    (9, 4, 200.0, 5, False), (6, 3, 0.0, 3, True), (12, 4, 5.0, 5, True), (3, 4, 200.0, 5, False),
])
def test_cake_selection_matches_definition(make_ctx, attn_row, top, phase, capacity, w, gamma, kernel, gaps):
    ctx = make_ctx(T=16, w=w, gaps=gaps, phase=phase)
    rule = CAKERule(window=w, gamma=gamma, kernel_size=kernel)
    got = rule.select(ctx, capacity)
    assert got.tolist() == naive_cake(ctx, attn_row, top, capacity, w, gamma, kernel, phase)


@pytest.mark.parametrize("tau1,tau2", [(1.0, 1.0), (1.6, 0.4), (0.8, 0.5)])
def test_cake_preference_matches_definition(make_ctx, attn_row, tau1, tau2):
    ctx = make_ctx(T=14, w=4, gaps=True)
    state = QueryWindow(4)
    state.queries, state.positions = ctx.queries, ctx.query_positions
    ctx.state = state
    got = CAKEAllocator(window=4, tau1=tau1, tau2=tau2).layer_statistic(ctx)
    assert got == pytest.approx(naive_preference(ctx, attn_row, 4, tau1, tau2), rel=1e-5)


def test_split_budgets_by_hand():
    # 0.1/0.3/0.6 of 100 -> 10, 30, 60; cap 40 moves 20 evenly to the two uncapped layers.
    assert split_budgets([1.0, 3.0, 6.0], 100, 40) == [20, 40, 40]
    # int() truncation leaves 1 token: it goes to the lowest-index layer below the cap.
    assert split_budgets([1.0, 1.0, 1.0], 10, 8) == [4, 3, 3]
    # Every layer capped: each keeps the whole context.
    assert split_budgets([5.0, 1.0], 50, 20) == [20, 20]
    # Proportional split, no cap.
    assert split_budgets([2.0, 1.0, 1.0], 40, 100) == [20, 10, 10]


@pytest.mark.parametrize("seed", range(20))
def test_split_budgets_sum_and_cap(seed):
    import random

    rng = random.Random(seed)
    L = rng.randint(1, 8)
    prefs = [rng.random() * 10 for _ in range(L)]
    limit = rng.randint(5, 50)
    total = rng.randint(L, L * limit)
    got = split_budgets(prefs, total, limit)
    assert sum(got) == total
    assert all(0 <= b <= limit for b in got)


def test_cake_rejects_bad_parameters_when_built():
    for bad, match in [({"kernel_size": 4}, "kernel_size"), ({"window": 0}, "window"), ({"gamma": -1.0}, "gamma")]:
        with pytest.raises(ValueError, match=match):
            CAKERule(**bad)
    for bad, match in [({"tau1": 0.0}, "tau1"), ({"window": 0}, "window")]:
        with pytest.raises(ValueError, match=match):
            CAKEAllocator(**bad)


def test_cake_allocator_splits_the_group_total_by_preference():
    from polykv.contract.allocators import AllocationRequest

    req = AllocationRequest(group_layers=(0, 1, 2), layers=(0, 1, 2), statistics=(1.0, 3.0, 6.0), total=3 * 44,
                            capacities=(44, 44, 44), context_tokens=52, num_kv_heads=2, final=True)
    got = CAKEAllocator(window=4).allocate(req).tolist()
    # non-window total 3 * 40 = 120 split 12 / 36 / 72, capped at 48: excess 24 -> 12 each to the two others
    assert got == [12 + 12 + 4, 36 + 12 + 4, 48 + 4] and sum(got) == 3 * 44


@pytest.mark.parametrize("capacity, window", [(8, 32), (40, 32), (20, 8), (9, 8)])
def test_cake_allocator_keeps_the_windows_inside_the_group_total(capacity, window):
    """The paper's budget includes the window: a group never holds more than its planned total, also when
    the total cannot hold one window per layer (every layer then keeps an equal share, all window)."""
    from polykv.contract.allocators import AllocationRequest

    L, S = 4, 100
    req = AllocationRequest(group_layers=tuple(range(L)), layers=tuple(range(L)), statistics=(1.0, 2.0, 3.0, 4.0),
                            total=L * capacity, capacities=(capacity,) * L, context_tokens=S, num_kv_heads=2,
                            final=True)
    got = CAKEAllocator(window=window).allocate(req).tolist()
    assert sum(got) == L * capacity and all(1 <= b <= S for b in got)
    if capacity >= window:
        assert all(b >= window for b in got)          # every layer keeps its window
    else:
        assert max(got) - min(got) <= 1               # an equal share of a total smaller than the windows


def _cake_group_plan(geo, *, capacity: int, rule_window: int | None = None, group_window: int | None = None):
    import attrs

    import polykv
    from polykv.plan import AllocationGroup

    params = {} if rule_window is None else {"window": rule_window}
    plan = polykv.uniform_plan(geo, prefill="cake", decode="cake", capacity=capacity, params=params)
    group = AllocationGroup(allocator="cake", layers=tuple(range(geo.num_layers)),
                            params={} if group_window is None else {"window": group_window})
    return attrs.evolve(plan, allocation=(group,))


@pytest.mark.parametrize("capacity", [8, 40])
def test_a_cake_group_holds_at_most_its_total_after_prefill_and_decode(capacity):
    import polykv
    from polykv.models.geometry import geometry_of_model
    from polykv.memory.report import memory_report
    from polykv.testing import tiny_model, token_ids

    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    geo = geometry_of_model(model)
    plan = _cake_group_plan(geo, capacity=capacity)
    total = 4 * capacity
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(token_ids(1, 100))
        held = [max(max(row) for row in a["stored"]) for a in session.allocations().values()]
        assert sum(held) <= total
        from polykv.runtime.fork import forward

        for _ in range(3):
            out = forward(session, out.logits[:, -1:].argmax(-1))
        budgets = [a["budget"] for a in session.allocations().values()]
    assert sum(budgets) <= total
    # what plan show states for the group is the bound the runtime keeps
    (name, bound), = memory_report(plan, geo, 100).group_bounds
    assert bound == total >= sum(held)


def test_a_cake_rule_window_other_than_its_allocators_is_refused_at_validation():
    import polykv
    from polykv.errors import PlanError
    from polykv.models.geometry import geometry_of_model
    from polykv.testing import tiny_model

    geo = geometry_of_model(tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16))
    for rule_window, group_window in [(8, None), (None, 8), (16, 8)]:
        plan = _cake_group_plan(geo, capacity=40, rule_window=rule_window, group_window=group_window)
        with pytest.raises(PlanError) as info:
            validate_plan(plan, registry=polykv.get_registry())
        text = str(info.value)
        assert "layers[0].prefill.params.window" in text and "allocator 'cake'" in text and "\n" not in text
    validate_plan(_cake_group_plan(geo, capacity=40, rule_window=8, group_window=8), registry=polykv.get_registry())


def test_the_cake_allocator_refuses_a_batch_of_several_rows():
    import polykv
    from polykv.errors import RuntimeConfigError
    from polykv.models.geometry import geometry_of_model
    from polykv.testing import tiny_model, token_ids

    model = tiny_model("llama", layers=4, heads=4, kv_heads=2, head_dim=16)
    plan = _cake_group_plan(geometry_of_model(model), capacity=40)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        with pytest.raises(RuntimeConfigError, match=r"allocator 'cake' .*batch of 2 rows.*one prompt at a time"):
            session.prefill(token_ids(2, 100))
