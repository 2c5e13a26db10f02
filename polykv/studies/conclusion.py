"""The conclusion a report opens with, and the glossary of the design names it uses.

Per task and budget: the plan that scores highest, its interval, its paired difference to the full cache
(when the study ran one), and which plans it is distinguishable from. A difference is claimed only when the
paired interval excludes zero *and* at least :func:`~polykv.profiling.stats.min_units_for_difference` items
disagree between the two plans (the exact sign test over fewer discordant items cannot reach the level,
whatever a bootstrap interval over them says). When no two plans at a budget can be told apart, the
conclusion says so, with the items a difference of the observed size would need.

``polykv report`` prints it as Markdown (:func:`conclusion_markdown`); ``polykv demo`` prints the same
sentences as plain text (:func:`conclusion_text`).
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Callable

import numpy as np

from polykv.errors import RegistryError
from polykv.registry import get_registry
from polykv.profiling.stats import Interval, min_units_for_difference, wilson_interval
from polykv.studies import designs
from polykv.studies.stats import FACTORIAL_CELLS
from polykv.studies.markdown import cell, line
from polykv.studies.results import Results

ROLE_DEFINITIONS = {
    "full": "the full cache: every token kept at 16 bits on every layer (the study's baseline)",
    "1d": "MoE-nD's `1d`: one eviction rule at one keep ratio on every layer, 16 bits (uniform eviction only)",
    "2d_uniform": "MoE-nD's `2d_uniform`: one rule, one keep ratio and one K/V width pair on every layer, the best "
                  "uniform (keep, K, V) that fits the budget",
    "2d": "MoE-nD's `2d`: one keep ratio on every layer (the largest a K8/V4 plan fits), K/V widths chosen per "
          "layer",
    "2d_hetero": "MoE-nD's `2d_hetero`: keep ratio and K/V widths chosen per layer",
    "homogeneous_uniform": "PolyKV factorial cell: one rule on every layer, the same capacity on every layer",
    "homogeneous_allocated": "PolyKV factorial cell: one rule on every layer, capacity allocated per layer",
    "routed_uniform": "PolyKV factorial cell: the rule routed per layer by the profile, the same capacity on every "
                      "layer",
    "routed_allocated": "PolyKV factorial cell: the rule routed per layer, capacity allocated per layer (joint)",
    "placement": "a count-matched random placement: the guided route's rules shuffled over the layers (each rule on "
                 "as many layers), the control of the placement rank test",
}
"""Each study role (:data:`polykv.studies.spec.ROLES`) as :mod:`polykv.studies.designs` compares it."""

CONTRAST_DEFINITIONS = {
    "d_quant": "2d - 2d_uniform: what per-layer K/V widths add at one keep",
    "d_evict": "2d_hetero - 2d: what per-layer keep ratios add",
    "d_total": "2d_hetero - 2d_uniform",
    "hetero_vs_1d": "2d_hetero - 1d",
    "hetero_vs_full": "2d_hetero - full",
    "route_only": "routed_uniform - homogeneous_uniform",
    "allocation_only": "homogeneous_allocated - homogeneous_uniform",
    "joint": "routed_allocated - homogeneous_uniform",
    "routing": "mean over capacity levels of (routed - homogeneous)",
    "allocation": "mean over rule levels of (allocated - uniform)",
    "interaction": "(routed_allocated - routed_uniform) - (homogeneous_allocated - homogeneous_uniform)",
}
"""The contrasts of MoE-nD's chain (:func:`polykv.studies.stats.moend_ablation`) and PolyKV's factorial
(:func:`polykv.studies.stats.polykv_factorial`)."""


def discordant(a: np.ndarray, b: np.ndarray) -> int:
    """Items on which two plans' scores differ."""
    return int(np.sum(np.asarray(a, float) != np.asarray(b, float)))


def varying(*scores: np.ndarray) -> int:
    """Items on which the plans' scores are not all equal: at most this many items can carry any contrast of them."""
    arrays = [np.asarray(s, float) for s in scores if np.size(s)]
    if len(arrays) < 2:
        return 0
    stacked = np.stack(arrays)
    return int(np.sum(np.any(stacked != stacked[:1], axis=0)))


def backed(iv: Interval, differing: int) -> bool:
    """True when ``iv`` shows a difference and at least :func:`min_units_for_difference` of its items differ."""
    return iv.shows_difference() and differing >= min_units_for_difference(iv.level)


def distinguishable(iv: Interval, a: np.ndarray, b: np.ndarray) -> bool:
    """True when the paired interval ``iv`` of ``a - b`` shows a difference and enough items disagree to back it."""
    return backed(iv, discordant(a, b))


def verdict(iv: Interval, a: np.ndarray, b: np.ndarray, against: str) -> str:
    """``differs from AGAINST at 95%``, ``no difference from AGAINST at 95%``, or, where the items cannot support
    a claim, how many that disagree it would need."""
    level, need = f"{iv.level:.0%}", min_units_for_difference(iv.level)
    if distinguishable(iv, a, b):
        return f"differs from {against} at {level}"
    if iv.excludes_zero():
        return (f"too few items to tell at {level}: {discordant(a, b)} of {iv.n} item(s) disagree, a difference "
                f"needs at least {need}")
    return f"no difference from {against} at {level}"


def items_needed(iv: Interval) -> int | None:
    """About how many items would resolve a difference of ``iv.estimate`` (its interval's half-width shrinks
    as 1/sqrt(n)); at least :func:`min_units_for_difference`. None when the estimate is 0."""
    if iv.estimate == 0 or iv.n < 1:
        return None
    half = max((iv.high - iv.low) / 2, 1e-12)
    return max(min_units_for_difference(iv.level), math.ceil(iv.n * (half / abs(iv.estimate)) ** 2))


def _score_text(scores: np.ndarray) -> str:
    if np.all((scores == 0) | (scores == 1)):
        w = wilson_interval(int(scores.sum()), int(scores.size))
        return f"{w.estimate:.1%} [{w.low:.1%}, {w.high:.1%}] (Wilson 95%, {_items(scores.size)})"
    return f"mean score {scores.mean():.3f} ({_items(scores.size)})"


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _diff_text(iv: Interval) -> str:
    return f"{iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"


def budget_conclusion(res: Results, task: str, budget: str, name: Callable[[str], str] = cell) -> str | None:
    """One sentence: the best plan at ``budget`` on ``task``, its interval, against the full cache, and which
    plans it is distinguishable from (or that none can be told apart, and the items that would take). Every name
    from the results file goes through ``name`` (Markdown: :func:`~polykv.studies.markdown.cell`)."""
    names = designs.plans_at(res, budget)
    scores = {n: res.scores(n, task) for n in names}
    names = [n for n in names if scores[n].size]
    if not names:
        return None
    means = {n: float(scores[n].mean()) for n in names}
    top = max(means.values())
    best = [n for n in names if means[n] == top]
    win = best[0]
    n_items = int(scores[win].size)
    level = min_units_for_difference()
    lead = (f"{name(win)} scores highest" if len(best) == 1 else
            "tied highest: " + ", ".join(name(n) for n in best) + f"; {name(win)}")
    out = f"At {name(budget)}, {lead}: {_score_text(scores[win])}"
    if "full" in res.policies and res.scores("full", task).size:
        iv = designs.paired_vs(res, task, win, "full")
        said = verdict(iv, scores[win], res.scores("full", task), "the full cache")
        out += f"; against the full cache {_diff_text(iv)} (paired bootstrap 95%): {said}"
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            iv = designs.paired_vs(res, task, a, b)
            pairs.append((a, b, iv, distinguishable(iv, scores[a], scores[b])))
    beaten = [b if a == win else a for a, b, _, ok in pairs if ok and win in (a, b)]
    if len(names) == 1:
        return out + "."
    if beaten:
        return out + "; it is distinguishable at 95% from " + ", ".join(name(n) for n in beaten) + "."
    if any(ok for *_, ok in pairs):
        return out + "; it is not distinguishable at 95% from any other plan here (other pairs differ: see below)."
    if n_items < level:
        return (out + f". No plan is distinguishable from another with n = {n_items} item(s): a difference at 95% "
                f"needs at least {level} items on which the two plans disagree.")
    a, b, iv, _ = max(pairs, key=lambda p: abs(p[2].estimate))
    need = items_needed(iv)
    tail = (f"; the largest observed gap, {name(a)} - {name(b)} = {iv.estimate:+.3f}, would need about {need} "
            f"items to resolve" if need else "; every plan scored the same on every item")
    return out + f". No plan is distinguishable from another at 95% with n = {n_items} items" + tail + "."


def conclusion_sentences(res: Results, name: Callable[[str], str] = cell) -> list[str]:
    """Per task and budget, one :func:`budget_conclusion` sentence prefixed by the task."""
    out = []
    for task in res.tasks:
        sub = res.for_task(task)
        for b in designs.budgets(sub):
            s = budget_conclusion(sub, task, b, name)
            if s:
                out.append(f"{name(task)}: {s}")
    return out


def conclusion_markdown(res: Results) -> list[str]:
    """The ``## Conclusion`` section of a report."""
    body = [f"- {s}" for s in conclusion_sentences(res)]
    if not body:
        return []
    return ["## Conclusion", "", *body, ""]


def conclusion_text(res: Results) -> list[str]:
    """The same sentences in plain text (``polykv demo``)."""
    return conclusion_sentences(res, name=lambda n: n)


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    cut = text.find(". ")
    return text if cut < 0 else text[:cut + 1]


def solver_definition(solver: str) -> str:
    """The first sentence of a registered solver's class docstring (its module's, when the class defers to it)."""
    try:
        cls = get_registry().solver(solver)
    except RegistryError:  # a solver no plugin registers any more: say so instead of failing the report
        return "a solver not registered in this installation"
    doc = inspect.getdoc(cls) or ""
    if "module docstring" in doc or not doc:
        module = sys.modules.get(cls.__module__)
        doc = (module.__doc__ if module else "") or doc
    return _first_sentence(doc).replace("``", "`")


def _param(key: str, value) -> str:
    """One solver parameter, short: a float to 4 digits, a list of more than 4 entries by its length."""
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    if isinstance(value, list) and len(value) > 4:
        return f"{key}=({len(value)} entries)"
    return f"{key}={value}"


def glossary(res: Results) -> list[tuple[str, str]]:
    """(design name, definition) for every method, role and contrast name the report uses."""
    out: dict[str, str] = {}
    roles, described = set(), set()
    for rec in res.policies.values():
        method, role, solver = rec.get("method") or rec.get("policy"), rec.get("role") or "", rec.get("solver")
        roles.add(role)
        if method in out:
            continue
        if role == "full":
            out[method] = ROLE_DEFINITIONS["full"]
            continue
        params = {k: v for k, v in ((rec.get("plan") or {}).get("provenance") or {}).get("params", {}).items()
                  if k not in ("index", "count") and v is not None} if solver else {}
        if solver:
            text = f"solver `{solver}`" + (f" ({', '.join(_param(k, v) for k, v in sorted(params.items()))})"
                                           if params else "") + f": {solver_definition(solver)}"
        elif rec.get("plan"):
            prov = rec["plan"].get("provenance") or {}
            made = f"made by solver `{prov['solver']}`" if prov.get("solver") else "hand-made"
            text = f"a plan file ({made}" + (f"; {prov['note']}" if prov.get("note") else "") + ")"
        else:
            text = "a policy whose plan the results file does not record"
        if role and role in ROLE_DEFINITIONS:
            text = text.rstrip(".") + f". Role `{role}`: {ROLE_DEFINITIONS[role]}"
            described.add(role)
        out[method] = text
    for role in sorted(roles - described):
        if role in ROLE_DEFINITIONS and role not in out:
            out[role] = ROLE_DEFINITIONS[role]
    if {"2d_uniform", "2d", "2d_hetero"} <= roles:
        chain = ["d_quant", "d_evict", "d_total"] + [f"hetero_vs_{r}" for r in ("1d", "full") if r in roles]
        out.update({k: CONTRAST_DEFINITIONS[k] for k in chain})
    if set(FACTORIAL_CELLS) <= roles:
        out.update({k: CONTRAST_DEFINITIONS[k] for k in ("route_only", "allocation_only", "joint", "routing",
                                                          "allocation", "interaction")})
    return list(out.items())


def glossary_markdown(res: Results) -> list[str]:
    """The ``## Glossary`` section: one line per design name."""
    terms = glossary(res)
    if not terms:
        return []
    return ["## Glossary", "", *[f"- **{cell(term)}**: {line(text)}" for term, text in terms], ""]

