"""Write the plans of the two- and three-axis comparison on Gemma 3 270M (``gemma3_passkey.json``).

Gemma 3 270M has 15 sliding-window layers (window 512) and 3 full-attention layers (5, 11, 17) of one KV head
x 256. The solvers keep the sliding layers at their window and route the full layers
(:mod:`polykv.solvers.windowed`), so every axis is routed on those three. The layer axis does not exist here:
MiniCache refuses windowed pairs and the three full layers are never adjacent. The profile
(``gemma3-four-axes.profile.json``, key/value bases beside it) measured four rules at every keep and width pair
and key and value ranks d, 3d/4, d/2 and d/4, l2 at the study's 2,048 tokens::

    polykv calibrate gemma3-270m -o bench/four_axes_study/gemma3-four-axes.profile.json --sequences 2 \\
        --tokens 2048 --prefix 1920 --seed 0 --threads 1 --rules snapkv,tova,streamingllm,h2o \\
        --ranks d,3d/4,d/2,d/4 --validate 0

At each budget (resident bytes at 2,048 tokens, bfloat16 storage; the ratio applies to the full layers):

- ``joint``: ``exact`` over tokens and bits (the full-rank configs: today's joint plan);
- ``joint-3axis``: ``exact`` over tokens, bits and rank (the whole profile), written only where it differs;
- ``joint-r128``: ``exact`` over the rank-128 (d/2) configs only: rank forced on every routed layer;
- ``uniform-2axis``: the ``uniform`` solver's best single-rule plan over the full-rank configs;
- ``uniform-r128``: that plan with keys and values at rank 128 on every full-attention layer and their keep raised
  until they fill the same budget (the bytes a lower rank frees buy more tokens).

    python bench/four_axes_study/make_gemma3_plans.py
"""

from __future__ import annotations

import os

from make_plans import rank_only, uniform_at_rank, write_plans

from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.solvers import solve

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "gemma3-four-axes.profile.json")
BUDGETS = ("4x", "8x", "12x")
CONTEXT = 2048
RANK = 128


def main() -> None:
    profile = load_profile(PROFILE)
    os.makedirs(os.path.join(HERE, "plans"), exist_ok=True)
    for b in BUDGETS:
        budget = Budget.parse(b, CONTEXT, basis="resident", cache_dtype="bfloat16")
        two_axes = profile.without_axes()
        plans = {
            "joint": solve(two_axes, budget, "exact"),
            "joint-3axis": solve(profile, budget, "exact"),
            f"joint-r{RANK}": solve(rank_only(profile, RANK), budget, "exact"),
            "uniform-2axis": solve(two_axes, budget, "uniform", mode="best"),
        }
        plans[f"uniform-r{RANK}"] = uniform_at_rank(plans["uniform-2axis"], budget, profile, RANK)
        if plans["joint-3axis"].layers == plans["joint"].layers:
            print(f"{b:>4} joint-3axis equal to joint: written once as joint")
            del plans["joint-3axis"]
        write_plans(plans, b, PROFILE, prefix="gemma3-270m.")


if __name__ == "__main__":
    main()
