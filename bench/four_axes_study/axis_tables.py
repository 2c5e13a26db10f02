"""Per-axis profile tables of the four-axis comparison: what one unit of each axis costs each layer, in l2.

From ``smollm2-four-axes.profile.json`` (see ``make_plans.py``), per layer:

- ``evict``: the lowest l2 of any rule keeping 25% of the context at 16 bits;
- ``K4V4``: keeping everything with keys and values at 4 bits;
- ``K8V8``: keeping everything at 8 bits;
- ``rank``: keeping everything at 16 bits with keys and values at rank 32 (d/2);
- ``pair``: sharing the layer with the one below it (MiniCache; the pair's loss, both layers' errors summed);

and the bytes each saves on the resident basis at 2,048 tokens, bfloat16 storage (a layer's bytes against its
16-bit full cache). The last line gives each axis's median l2 per byte saved over layers, the quantity the exact
solver trades.

    python bench/four_axes_study/axis_tables.py
    python bench/four_axes_study/axis_tables.py --profile bench/four_axes_study/gemma3-four-axes.profile.json --rank 128

On a model with window-bounded layers (Gemma 3) only the layers a plan routes are listed, and a profile without a
pair table (no ``--pairs``, or no adjacent full-attention layers) has no ``pair`` column.
"""

from __future__ import annotations

import argparse
import os

import attrs
import numpy as np

from polykv.plan import FULL_OP, LayerPlan, OpSpec
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.solvers.windowed import window_bounds

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=os.path.join(HERE, "smollm2-four-axes.profile.json"))
    ap.add_argument("--rank", type=int, default=32, help="the key and value rank of the rank column (default 32)")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    R = args.rank
    l2 = profile.table("l2")
    L = profile.num_layers
    budget = Budget.parse("1x", 2048, basis="resident", cache_dtype="bfloat16")
    reg = get_registry()
    full_bits = budget.layer_bits(profile.model, LayerPlan(layer=0), reg)

    def col(pred) -> np.ndarray:
        idx = [j for j, c in enumerate(profile.configs) if pred(c)]
        return l2[:, idx].min(axis=1)

    def saved(lp: LayerPlan) -> float:
        return 1 - budget.layer_bits(profile.model, lp, reg) / full_bits

    evict = col(lambda c: c.keep == 0.25 and c.k_bits == c.v_bits == 16 and not c.low_rank)
    k4 = col(lambda c: c.keeps_everything and c.k_bits == c.v_bits == 4 and not c.low_rank)
    k8 = col(lambda c: c.keeps_everything and c.k_bits == c.v_bits == 8 and not c.low_rank)
    rank = profile.stats["rank_l2"]
    r32 = rank.values[:, rank.columns.index(f"K{R}V{R}")]
    pair = np.full(L, np.nan)
    if profile.pairs is not None:
        pair[list(profile.pairs.uppers)] = profile.pairs.loss
        pair_saved = 1 - budget.pair_bits(profile.model, profile.pairs.share_params, reg, bound=False) / (2 * full_bits)
    savings = {
        "evict": saved(attrs.evolve(LayerPlan(layer=0), prefill=OpSpec(rule="snapkv", capacity_ratio=0.25),
                                    decode=FULL_OP)),
        "K4V4": saved(LayerPlan(layer=0, k_bits=4, v_bits=4)),
        "K8V8": saved(LayerPlan(layer=0, k_bits=8, v_bits=8)),
        "rank": saved(LayerPlan(layer=0, k_rank=R, v_rank=R)),
    }
    if profile.pairs is not None:
        savings["pair"] = pair_saved
    bounds = window_bounds(profile.model)
    routed = [i for i in range(L) if i not in bounds]
    print(f"l2 per layer ({profile.model.model_type}, {profile.provenance.corpus.split(':')[0]}; rank {R}"
          + (f"; the {len(bounds)} window-bounded layers, never routed, left out" if bounds else "") + ")")
    print("layer   evict    K4V4    K8V8    rank    pair")
    for layer in routed:
        p = "-" if np.isnan(pair[layer]) else f"{pair[layer]:.3f}"
        print(f"{layer:5} {evict[layer]:7.3f} {k4[layer]:7.3f} {k8[layer]:7.3f} {r32[layer]:7.3f} {p:>7}")
    print("bytes saved per layer (resident, 2,048 tokens, bfloat16): " + ", ".join(
        f"{k} {v:.0%}" for k, v in savings.items()) + " (pair: of its two layers, unmerged tokens and magnitudes counted)")
    per_byte = {"evict": evict[routed], "K4V4": k4[routed], "K8V8": k8[routed], "rank": r32[routed]}
    if profile.pairs is not None:
        per_byte["pair"] = pair[~np.isnan(pair)] / 2  # a pair's loss over its two layers' bytes
    print("median l2 per unit of the layer's bytes saved: " + ", ".join(
        f"{k} {np.median(v) / savings[k]:.3f}" for k, v in per_byte.items()))


if __name__ == "__main__":
    main()
