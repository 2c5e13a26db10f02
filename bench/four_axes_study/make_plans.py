"""Write the plans of the two-, three- and four-axis comparison (``passkey.json``) from one four-axis profile.

The profile (``smollm2-four-axes.profile.json``, key/value bases beside it) measured SmolLM2-135M over five rules at
every keep and width pair, key and value ranks d, 3d/4, d/2, d/4 and every adjacent layer pair (MiniCache), l2 at
640 tokens; it was calibrated with::

    polykv calibrate default -o bench/four_axes_study/smollm2-four-axes.profile.json --sequences 4 --tokens 640 \\
        --prefix 512 --seed 0 --threads 1 --rules snapkv,tova,streamingllm,h2o,pyramidkv \\
        --ranks d,3d/4,d/2,d/4 --pairs --validate 0

At each budget (resident bytes at 2,048 tokens, bfloat16 storage) the same ``exact`` solver routes

- ``joint-2axis``: tokens and bits (the profile's full-rank configs, no pair table: today's joint plan);
- ``joint-3axis``: tokens, bits and rank (the pair table left out);
- ``joint-4axis``: tokens, bits, rank and layer pairs (the whole profile);

At 4x-12x the solver uses neither rank nor sharing (both cost more measured error per byte saved than eviction and
bits), so the three joint plans are one plan, run once as ``joint``. What the extra axes do when used is then measured
with two forced plans, each solved by the same ``exact`` solver over what is left:

- ``joint-r32`` (three axes): every layer at rank 32 (d/2) for keys and values; the solver routes rule, keep and
  widths over the profile's rank-32 columns;
- ``joint-shared`` (four axes): the pair of lowest measured loss shared (MiniCache), every other layer routed over
  the whole profile (rank included) in the bytes the pair leaves; the pair is forced on the chain DP (its loss set to 0,
  every config of its layers made dearer) and the plan's predicted loss is reported with the pair's measured loss.

and the uniform counterparts are

- ``uniform-2axis``: the ``uniform`` solver's best single-rule plan (one rule, keep and width pair on every layer);
- ``uniform-r32``: that plan with keys and values at rank 32 (d/2) on every layer and the keep raised until the layers
  fill the same budget (the bytes a lower rank frees buy more tokens). Rank 32 is the only lower rank KIVI can code
  at these widths: its 32-channel key groups do not divide 48 or 16.

A uniform four-axis plan does not exist at these budgets: a shared pair stores its layers uncompressed (MiniCache
refuses eviction, quantization and rank on a shared pair), so sharing every pair caps the cache at about 2x.

    python bench/four_axes_study/make_plans.py
"""

from __future__ import annotations

import os

import attrs
import numpy as np

from polykv.commands.solve import with_profile_data
from polykv.plan import Provenance
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.solvers import solve
from polykv.solvers.windowed import window_bounds

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "smollm2-four-axes.profile.json")
BUDGETS = ("4x", "8x", "12x")
CONTEXT = 2048
RANKS = (32,)


def uniform_at_rank(plan, budget: Budget, profile, rank: int):
    """``plan`` (a uniform single-rule plan) with keys and values at ``rank`` on every routed layer and their keep
    raised to fill ``budget`` again; window-bounded layers (Gemma 3's sliding layers) keep their window at full
    rank, and the budget is counted over the routed layers as the solvers count it."""
    registry = get_registry()
    bounds = window_bounds(profile.model)
    routed = attrs.evolve(profile.model, num_layers=profile.model.num_layers - len(bounds))
    first = next(attrs.evolve(lp, k_rank=rank, v_rank=rank) for lp in plan.layers if lp.layer not in bounds)
    tokens = budget.uniform_tokens(routed, first.k_bits, first.v_bits, layer=first, registry=registry)
    T = budget.context_tokens
    keep = min(tokens, T) / T
    layers = []
    for lp in plan.layers:
        if lp.layer in bounds:
            layers.append(lp)
            continue
        ops = {}
        for phase in ("prefill", "decode"):
            op = getattr(lp, phase)
            ops[phase] = op if op.keeps_everything else attrs.evolve(op, capacity=None, capacity_ratio=keep)
        layers.append(attrs.evolve(lp, k_rank=rank, v_rank=rank, **ops))
    where = "every full-attention layer" if bounds else "every layer"
    note = (f"{plan.provenance.note}; by hand: keys and values at rank {rank} on {where}, keep raised to "
            f"{keep:.4g} ({min(tokens, T)} of {T} tokens) to fill the same budget")
    provenance = Provenance(solver="hand", budget=plan.provenance.budget, context_tokens=T, note=note)
    out = attrs.evolve(plan, layers=tuple(layers), provenance=provenance)
    used = budget.plan_bits(routed, [lp for lp in out.layers if lp.layer not in bounds], registry)
    assert used <= budget.to_bits(routed), (used, budget.to_bits(routed))
    return out


def rank_only(profile, rank: int):
    """``profile`` with only its configs at ``rank`` for keys and values, and no pair table."""
    cols = [i for i, c in enumerate(profile.configs) if c.k_rank == rank and c.v_rank == rank]
    return attrs.evolve(profile, configs=[profile.configs[i] for i in cols], pairs=None,
                        metrics={k: v[:, cols] for k, v in profile.metrics.items()})


FORCE = 1000.0


def forced_pair(profile):
    """``profile`` whose pair table holds only its pair of lowest loss, measured as free (0), with ``FORCE`` added to
    every config of that pair's two layers, so that the chain DP always shares it; returns the profile and the pair's
    measured loss."""
    pairs = profile.pairs
    j = int(np.argmin(pairs.loss))
    upper = pairs.uppers[j]
    metrics = {}
    for k, v in profile.metrics.items():
        v = np.array(v, dtype=np.float64)
        v[[upper - 1, upper], :] += FORCE
        metrics[k] = v
    forced = attrs.evolve(pairs, uppers=[upper], values=np.zeros((1, 2)))
    return attrs.evolve(profile, pairs=forced, metrics=metrics), float(pairs.loss[j])


def main() -> None:
    profile = load_profile(PROFILE)
    three_axes = attrs.evolve(profile, pairs=None)
    shared_profile, pair_loss = forced_pair(profile)
    os.makedirs(os.path.join(HERE, "plans"), exist_ok=True)
    for b in BUDGETS:
        budget = Budget.parse(b, CONTEXT, basis="resident", cache_dtype="bfloat16")
        plans = {
            "joint-2axis": solve(profile.without_axes(), budget, "exact"),
            "joint-3axis": solve(three_axes, budget, "exact"),
            "joint-4axis": solve(profile, budget, "exact"),
            "uniform-2axis": solve(profile, budget, "uniform", mode="best"),
        }
        for r in RANKS:
            plans[f"joint-r{r}"] = solve(rank_only(profile, r), budget, "exact")
            plans[f"uniform-r{r}"] = uniform_at_rank(plans["uniform-2axis"], budget, profile, r)
        shared = solve(shared_profile, budget, "exact")
        assert shared.share_pairs(), "the forced pair was not shared"
        loss = shared.provenance.predicted_loss + pair_loss
        plans["joint-shared"] = attrs.evolve(shared, provenance=attrs.evolve(
            shared.provenance, predicted_loss=loss,
            note=f"{shared.provenance.note}; by hand: the pair of lowest measured loss ({pair_loss:.3f}) forced shared, "
                 f"the other layers routed by exact in the bytes it leaves"))
        same = [n for n in ("joint-3axis", "joint-4axis") if plans[n].layers == plans["joint-2axis"].layers]
        print(f"{b:>4} {', '.join(same) or 'no plan'} equal to joint-2axis: written once as joint")
        plans["joint"] = plans.pop("joint-2axis")
        for n in same:
            del plans[n]
        write_plans(plans, b, PROFILE)


def write_plans(plans: dict, budget: str, profile_path: str, prefix: str = "") -> None:
    """Save each plan as ``plans/{prefix}{name}.{budget}.plan.json`` (naming the profile's side files) and print it."""
    for name, plan in plans.items():
        path = os.path.join(HERE, "plans", f"{prefix}{name}.{budget}.plan.json")
        with_profile_data(plan, profile_path).save(path)
        loss = plan.provenance.predicted_loss
        print(f"{budget:>4} {name:14} axes {'+'.join(plan.axes_used()):24} predicted l2 "
              f"{'-' if loss is None else f'{loss:.3f}':>7}  {plan.provenance.note[:110]}")


if __name__ == "__main__":
    main()
