"""The rank and layer-sharing axes priced end to end, on the same objectives as the eviction configs.

``rank_l2`` and the pair table (:mod:`polykv.profiling.rank_error`, :mod:`polykv.profiling.share_error`) price a rank
or a shared pair by the error of one layer's attention output, while a profile with held-out sequences prices its
eviction and width configs by what the whole model predicts (:mod:`polykv.profiling.endtoend`). A solver comparing
bytes against loss across axes needs one scale, so here the rank and sharing configs are measured the way eviction
configs are: as plans that change one layer (a rank pair at 16 bits, every token kept) or one adjacent pair (the
upper layer shares the lower one's prefix, ``LayerPlan.share``), their caches restored from an uncompressed prefill
of each held-out prefix, only the follow-up forward run (from the changed layer up, the layers below computing what
the full plan computes), and ``KL(full || plan)`` taken at each objective's scored positions.

A rank plan attends in code space during the prefill, so it is prefilled once per (layer, rank pair, prefix);
a sharing plan keeps every token at 16 bits and restores from the plain prefill the eviction configs share.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from polykv.plan import Plan, full_plan
from polykv.profiling import endtoend as e2e
from polykv.runtime.fork import plan_ranks


def rank_plan(geometry, layer: int, k_rank: int | None, v_rank: int | None) -> Plan:
    """The full plan but ``layer``, which stores its keys and values in codes of these ranks (16 bits, every token
    kept): what ``rank_l2``'s column ``K<k>V<v>`` measures on one layer, as a plan."""
    return full_plan(geometry).with_layer(layer, k_rank=k_rank, v_rank=v_rank)


def pair_plan(geometry, upper: int, share_params: Mapping[str, Any] | None = None) -> Plan:
    """The full plan but the pair (``upper`` - 1, ``upper``), which shares its prefix (MiniCache, as a plan of the
    ``exact`` solver shares it)."""
    return full_plan(geometry).with_layer(upper, share=upper - 1, share_params=dict(share_params or {}))


def plans_kl(model, layer: int, plans: Sequence[Plan], items: Sequence[torch.Tensor], references, prompts,
             prompt_ids: Sequence[torch.Tensor], prefix: int, *, rows, below, plain: Sequence, model_data=None,
             registry=None, seed: int = 0, tick: Callable[[], None] | None = None) -> np.ndarray:
    """[items, plans] ``KL(full || plan)`` of plans whose first changed layer is ``layer``, per item (``items`` [P + F]
    ids; ``references`` a :class:`~polykv.profiling.endtoend.KLReference` of each on its scored ``rows``; ``prompts``
    the index of each item's prefix in ``prompt_ids``; ``below`` a :class:`~polykv.profiling.endtoend.LayerOutputs`
    per item; ``plain`` the plain prefill snapshot of each prefix)."""
    out = np.zeros((len(items), len(plans)))
    for j, plan in enumerate(plans):
        if plan_ranks(plan) is None:
            snaps = plain
        else:
            own = e2e.PrefixSnapshots(model, prompt_ids, {layer: [plan]}, registry=registry, model_data=model_data)
            snaps = own.get(own.key(plan, layer))
        for i, (ids, ref) in enumerate(zip(items, references)):
            logits = e2e.followup_logits(model, plan, snaps[prompts[i]], ids, prefix, model_data=model_data,
                                         registry=registry, seed=seed, layer=layer, entering=below[i].entering(layer))
            out[i, j] = ref.kl(logits[list(rows[i])])
        if tick is not None:
            tick()
    return out
