"""The checks :class:`~polykv.contract.rules.ScoredRule` runs on a rule's own scores, and the switch of the
expensive checks.

A rule's ``score()`` must return a float tensor of exactly [B, Hkv, T] (always checked); with the expensive
checks on (``POLYKV_CHECK=1`` or ``polykv.apply(..., check=True)``), no NaN may sit among the scores that decide.
A failure is one :class:`~polykv.errors.PluginContractError` line naming the layer, the phase and the rule.
The runtime's checks of everything else plugins return live in :mod:`polykv.runtime.plugin_results`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from polykv.errors import PluginContractError, RuntimeConfigError

CHECK_ENV = "POLYKV_CHECK"
"""Environment variable that turns the expensive checks on (``1``) everywhere."""


def checks_enabled(check: bool | None = None) -> bool:
    """Whether the expensive checks run: ``check`` when given, else ``POLYKV_CHECK`` (``1``/``true``/``yes``)."""
    if check is not None:
        return bool(check)
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def where(layer: int, phase: str, kind: str, name: str) -> str:
    """The head of every contract message: ``layer 3 (decode): rule 'h2o'``."""
    return f"layer {layer} ({phase}): {kind} '{name}'"


# -- rules -----------------------------------------------------------------------------------------

def checked_scores(rule, scores: Any, ctx) -> torch.Tensor:
    """``rule.score(ctx)`` must be a float tensor of shape exactly [B, Hkv, T] ([B, 1, T] is allowed
    when the rule is ``shared_across_heads``); nothing is broadcast."""
    B, Hkv, T = ctx.positions.shape
    head = where(ctx.layer_idx, ctx.phase, "rule", rule.name)
    shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else None
    allowed = [(B, Hkv, T)] + ([(B, 1, T)] if getattr(rule, "shared_across_heads", False) else [])
    if shape not in allowed:
        got = f"shape {shape}" if shape is not None else f"a {type(scores).__name__}"
        raise PluginContractError(f"{head} score() returned {got}; expected [B, Hkv, T] = {allowed[0]} "
                                  f"(nothing is broadcast; fix the rule's score())")
    if not scores.is_floating_point():
        raise PluginContractError(f"{head} score() returned dtype {scores.dtype}; expected a floating-point "
                                  f"[B, Hkv, T] tensor (fix the rule's score())")
    return scores


def check_deciding_scores(rule, scores: torch.Tensor, ctx) -> None:
    """Expensive: no NaN among the scores that decide (protected columns already +inf, padding -inf)."""
    if bool(torch.isnan(scores).any()):
        bad = torch.isnan(scores).sum().item()
        stored = [t for t in (getattr(ctx, "keys", None), getattr(ctx, "values", None)) if isinstance(t, torch.Tensor)]
        broken = sum(int((~torch.isfinite(t)).sum()) for t in stored)
        if broken:  # the model's own activations overflowed: no rule can score them
            raise RuntimeConfigError(
                f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)}: the model's keys/values hold {broken} "
                f"non-finite value(s) (inf or NaN) before the rule scored them: the model overflows in "
                f"{stored[0].dtype} (Gemma 3 does in float16, without polykv too); load it in torch.bfloat16 or "
                f"torch.float32")
        raise PluginContractError(f"{where(ctx.layer_idx, ctx.phase, 'rule', rule.name)} score() returned {bad} "
                                  f"NaN score(s) on stored tokens; expected finite scores or +-inf "
                                  f"(fix the rule's score())")
