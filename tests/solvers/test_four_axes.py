"""The exact solver over four axes: eviction, bits, ranks (more knapsack columns) and shared pairs (the chain DP).

Brute force enumerates every cover of the layer chain by single-layer configs and shared pairs on tiny profiles;
the solver must reach its optimum within the budget, and profiles without rank or pair data must solve exactly as
before."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest

from polykv.memory import held_bytes_per_layer
from polykv.profiling.budget import Budget
from polykv.profiling.profile import CandidateConfig, PairTable, Profile
from polykv.solvers import solve
from polykv.solvers.base import Solver, config_bits
from polykv.solvers.chain import PAIRED, solve_chain
from polykv.solvers.mckp import Infeasible, solve_mckp

T = 256
DIMS = (4, 2, 32)


def four_axis_profile(seed: int, L: int = 4, pair_scale: float = 0.3) -> Profile:
    rng = np.random.default_rng(seed)
    base = [CandidateConfig(rule="full", keep=1.0), CandidateConfig(rule="full", keep=1.0, k_bits=8, v_bits=8),
            CandidateConfig(rule="snapkv", keep=0.25, phase="prefill"),
            CandidateConfig(rule="snapkv", keep=0.5, phase="prefill", k_bits=8, v_bits=8)]
    ranks = [(16, None), (None, 16), (16, 16)]   # KIVI codes 16 channels at 16 bits only (groups of 32)
    configs = base + [attrs.evolve(c, k_rank=k, v_rank=v) for c in base if c.k_bits == 16 for k, v in ranks]
    table = rng.uniform(0.0, 1.0, (L, len(configs)))
    table[:, 0] = 0.0
    prof = Profile.from_table(table, configs, (L, DIMS[1], DIMS[2]))
    pairs = PairTable(uppers=range(1, L), values=rng.uniform(0, pair_scale, (L - 1, 2)))
    return attrs.evolve(prof, pairs=pairs)


def brute_force(profile: Profile, budget: Budget) -> float | None:
    """Minimum summed loss over every cover of the layers by configs and measured pairs within the budget."""
    table = profile.table()
    bits = config_bits(profile, budget, Solver())
    pair_bits = budget.pair_bits(profile.model, profile.pairs.share_params)
    pair_loss = dict(zip(profile.pairs.uppers, profile.pairs.loss))
    cap, L = budget.to_bits(profile.model), profile.num_layers
    best = None

    def covers(k):
        if k == L:
            yield []
            return
        for c in range(len(profile.configs)):
            for rest in covers(k + 1):
                yield [(k, c)] + rest
        if k + 1 in pair_loss:
            for rest in covers(k + 2):
                yield [(k + 1, PAIRED)] + rest

    for cover in covers(0):
        w = sum(pair_bits if c == PAIRED else bits[c] for _, c in cover)
        s = sum(pair_loss[k] if c == PAIRED else table[k, c] for k, c in cover)
        if w <= cap and (best is None or s < best):
            best = float(s)
    return best


def plan_loss(plan, profile: Profile) -> float:
    labels = {c.label: i for i, c in enumerate(profile.configs)}
    pair_loss = dict(zip(profile.pairs.uppers, profile.pairs.loss))
    shared = {x for lo, hi in plan.share_pairs() for x in (lo, hi)}
    total = sum(pair_loss[hi] for _, hi in plan.share_pairs())
    for lp in plan.layers:
        if lp.layer in shared:
            continue
        op = lp.prefill if not lp.prefill.keeps_everything else lp.decode
        keep = 1.0 if op.keeps_everything else op.capacity_ratio
        cfg = CandidateConfig(rule=op.rule if keep < 1 else "full", keep=keep, phase="prefill" if keep < 1 else "both",
                              k_bits=lp.k_bits, v_bits=lp.v_bits, k_rank=lp.k_rank, v_rank=lp.v_rank)
        total += profile.table()[lp.layer, labels[cfg.label]]
    return float(total)


def held(plan, budget: Budget) -> int:
    return sum(held_bytes_per_layer(plan, plan.model, budget.context_tokens, dtype_bytes=budget.dtype_bytes))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ratio", [1.5, 2.5, 4.0])
def test_exact_over_four_axes_equals_brute_force(seed, ratio):
    prof = four_axis_profile(seed, L=3 + seed % 2, pair_scale=0.3 if seed % 2 else 1.5)
    budget = Budget.parse(f"{ratio}x", T, basis="resident")
    best = brute_force(prof, budget)
    if best is None:
        with pytest.raises(Exception, match="minimum feasible budget"):
            solve(prof, budget, "exact")
        return
    plan = solve(prof, budget, "exact")
    assert plan.provenance.predicted_loss == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan_loss(plan, prof) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert held(plan, budget) <= budget.to_bytes(prof.model)               # the memory model's own count
    assert plan.provenance.predicted_bytes == held(plan, budget)
    assert "routed axes: tokens, bits, rank, layers" in plan.provenance.note


@pytest.mark.parametrize("context", [256, 2048])
def test_the_solver_uses_every_axis_when_each_pays(context):
    """Five layers, each with one cheap way to compress: eviction on layer 0, bits on layer 1, ranks on layer 2, and
    sharing on the pair 3-4; at a budget of exactly that plan's bytes the solver must find it."""
    prof = four_axis_profile(0, L=5)
    labels = [c.label for c in prof.configs]
    cheap = {0: "snapkv@0.25/prefill/K16V16", 1: "full@1/both/K8V8", 2: "full@1/both/K16V16/R16x16"}
    table = np.full((5, len(labels)), 10.0)
    table[:, labels.index("full@1/both/K16V16")] = 0.0
    for layer, label in cheap.items():
        table[layer, labels.index(label)] = 1e-3
    pairs = PairTable(uppers=[1, 2, 3, 4], values=[[10, 10], [10, 10], [10, 10], [5e-4, 5e-4]])
    prof = attrs.evolve(prof, metrics={"l2": table}, pairs=pairs)
    ratio = Budget.parse("1x", context, basis="resident")
    bits = config_bits(prof, ratio, Solver())
    need = sum(bits[labels.index(v)] for v in cheap.values()) + ratio.pair_bits(prof.model)
    budget = Budget.of_bytes(-(-int(need) // 8), context, basis="resident")
    plan = solve(prof, budget, "exact")
    assert plan.share_pairs() == [(3, 4)], plan.provenance.note
    assert [lp.prefill.rule for lp in plan.layers[:3]] == ["snapkv", "full", "full"]
    assert (plan.layers[1].k_bits, plan.layers[1].v_bits) == (8, 8)
    assert (plan.layers[2].k_rank, plan.layers[2].v_rank) == (16, 16) and plan.low_rank
    assert plan.provenance.predicted_loss == pytest.approx(4e-3)
    assert held(plan, budget) <= budget.to_bytes(prof.model)
    with pytest.raises(Exception, match="minimum feasible budget"):  # nothing lighter exists
        solve(prof, Budget.of_bytes(int(min(bits)) * 5 // 8 - 1, context, basis="resident"), "exact")


def test_chain_solver_equals_brute_force_on_random_instances():
    rng = np.random.default_rng(1)
    solved = 0
    for _ in range(300):
        L, C = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        loss, w = rng.random((L, C)).round(2), rng.integers(1, 20, (L, C))
        pl = np.where(rng.random(L) < 0.7, rng.random(L).round(2), np.nan)
        pw = rng.integers(1, 30, L)
        cap = int(rng.integers(1, 60))
        best = None
        for tiling in _tilings(L, {k for k in range(1, L) if np.isfinite(pl[k])}):
            for choice in itertools.product(range(C), repeat=sum(1 for t in tiling if t[1] is None)):
                it = iter(choice)
                items = [(k, next(it) if c is None else PAIRED) for k, c in tiling]
                wt = sum(pw[k] if c == PAIRED else w[k, c] for k, c in items)
                s = sum(pl[k] if c == PAIRED else loss[k, c] for k, c in items)
                if wt <= cap and (best is None or s < best):
                    best = s
        if best is None:
            with pytest.raises(Infeasible):
                solve_chain(loss, w, cap, pl, pw)
            continue
        choice, uppers, s, wt = solve_chain(loss, w, cap, pl, pw)
        assert s == pytest.approx(best, abs=1e-12) and wt <= cap
        paired = {x for u in uppers for x in (u - 1, u)}
        assert set(np.flatnonzero(choice == PAIRED)) == paired
        assert sum(pw[u] for u in uppers) + sum(w[k, c] for k, c in enumerate(choice) if c != PAIRED) == wt
        assert sum(pl[u] for u in uppers) + sum(loss[k, c] for k, c in enumerate(choice) if c != PAIRED) \
            == pytest.approx(s, abs=1e-12)
        solved += 1
    assert solved > 100


def _tilings(L, pairs, k=0):
    """Covers of 0..L-1 by singles (k, None) and pairs (upper, 'pair')."""
    if k == L:
        yield []
        return
    for rest in _tilings(L, pairs, k + 1):
        yield [(k, None)] + rest
    if k + 1 in pairs:
        for rest in _tilings(L, pairs, k + 2):
            yield [(k + 1, "pair")] + rest


def test_chain_without_pairs_equals_mckp():
    rng = np.random.default_rng(2)
    for _ in range(50):
        loss, w = rng.random((5, 4)), rng.integers(1, 50, (5, 4))
        cap = int(w.min(1).sum() + rng.integers(0, 100))
        choice, uppers, s, wt = solve_chain(loss, w, cap, np.full(5, np.nan), np.zeros(5, np.int64))
        assert uppers == [] and s == pytest.approx(solve_mckp(loss, w, cap)[1])


def _two_axis(prof: Profile) -> Profile:
    return Profile.from_table(prof.table()[:, :4], prof.configs[:4], (prof.num_layers, DIMS[1], DIMS[2]))


@pytest.mark.parametrize("ratio", [1.5, 2.5, 3.5])
def test_profiles_without_rank_or_pair_data_solve_as_before(ratio, monkeypatch):
    """A two-axis profile takes the multiple-choice knapsack path (the chain solver is never called), and adding
    rank configs and pairs that never pay leaves the plan as it was."""
    prof = four_axis_profile(3)
    old = _two_axis(prof)
    budget = Budget.parse(f"{ratio}x", T, basis="resident")
    worse = attrs.evolve(prof, metrics={"l2": np.concatenate([old.table(), np.full((4, len(prof.configs) - 4), 50.0)],
                                                             axis=1)},
                         pairs=attrs.evolve(prof.pairs, values=np.full((3, 2), 50.0)))
    import polykv.solvers.chain as chain

    monkeypatch.setattr(chain, "solve_chain", lambda *a, **k: pytest.fail("the chain solver ran on a 2-axis profile"))
    before = solve(old, budget, "exact")
    assert "routed axes" not in before.provenance.note
    monkeypatch.undo()
    after = solve(worse, budget, "exact")
    assert after.layers == before.layers
    assert after.provenance.predicted_loss == before.provenance.predicted_loss


@pytest.mark.parametrize("solver", ["moend-greedy", "uniform", "quant-only"])
def test_solvers_that_route_two_axes_see_the_full_rank_configs_only(solver):
    prof = four_axis_profile(1)
    budget = Budget.parse("2x", T, basis="resident")
    params = {"rule": "snapkv"} if solver == "moend-greedy" else {}
    try:
        want = solve(_two_axis(prof), budget, solver, **params)
    except Exception as exc:  # a solver that cannot run on this grid must refuse both alike
        with pytest.raises(type(exc)):
            solve(prof, budget, solver, **params)
        return
    got = solve(prof, budget, solver, **params)
    assert got.layers == want.layers and not got.low_rank and not got.share_pairs()
    assert got.provenance.profile_fingerprint == prof.fingerprint


def test_pairs_are_routed_on_l2_only():
    prof = four_axis_profile(0)
    prof = attrs.evolve(prof, metrics={"l2": prof.table(), "kl": prof.table()})
    with pytest.raises(Exception, match="metric 'l2' only"):
        solve(prof, Budget.parse("2x", T, basis="resident"), "exact", metric="kl")


def test_plan_show_prints_every_axis_of_a_solved_four_axis_plan():
    from polykv.commands.plan import format_plan

    prof = four_axis_profile(0, L=5)
    labels = [c.label for c in prof.configs]
    table = np.full((5, len(labels)), 10.0)
    table[:, labels.index("full@1/both/K16V16")] = 0.0
    for layer, label in {0: "snapkv@0.25/prefill/K16V16", 1: "full@1/both/K8V8", 2: "full@1/both/K16V16/R16x16"}.items():
        table[layer, labels.index(label)] = 1e-3
    prof = attrs.evolve(prof, metrics={"l2": table}, pairs=PairTable(uppers=[4], values=[[5e-4, 5e-4]]))
    plan = solve(prof, Budget.parse("1.6x", 2048, basis="resident"), "exact")
    text = format_plan(plan, "p.json", 2048)
    header = next(line for line in text.splitlines() if line.startswith("LAYER"))
    assert header.split() == ["LAYER", "PREFILL", "DECODE", "K", "V", "QUANTIZER", "K_RANK", "V_RANK", "SHARE"]
    assert "share    1 layer pair(s)" in text and "3-4" in text
    assert "routed axes: tokens, bits, rank, layers" in text


def test_a_plan_names_the_axes_it_compresses():
    from polykv.models.geometry import ModelGeometry
    from polykv.plan import OpSpec, uniform_plan

    geo = ModelGeometry(model_type="llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4)
    full = uniform_plan(geo)
    assert full.axes_used() == ()
    evict = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=16))
    assert evict.axes_used() == ("tokens",)
    both = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=16), k_bits=4, v_bits=4)
    assert both.axes_used() == ("tokens", "bits")
    ranked = both.with_layer(1, k_rank=16, v_rank=16)
    assert ranked.axes_used() == ("tokens", "bits", "rank")
    shared = ranked.with_layer(2, prefill=OpSpec(rule="full"), k_bits=16, v_bits=16).with_layer(
        3, prefill=OpSpec(rule="full"), k_bits=16, v_bits=16, share=2)
    assert shared.axes_used() == ("tokens", "bits", "rank", "layers")
