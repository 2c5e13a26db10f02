"""A report opens with what it concludes and the names it uses; it claims a difference only where the items allow."""

from __future__ import annotations

import json

import numpy as np

from polykv.commands.demo import print_table
from polykv.studies import designs, predicted
from polykv.studies.conclusion import (budget_conclusion, conclusion_text, discordant, distinguishable, glossary,
                                       items_needed)
from polykv.studies.report import write_report
from polykv.studies.results import FORMAT, Results


def write_results(path, scores: dict[str, list[float]], *, roles=None, task="passkey", context=100, extra=None,
                  plans=None, policy_extra=None):
    """A results file of hand-chosen scores: ``full`` has no budget, every other policy ``name@B`` budget B."""
    roles = roles or {}
    lines = [{"kind": "header", "format": FORMAT, "version": 1, "spec_hash": "spec-x",
              "spec": {"name": "hand", "context_tokens": context}}]
    for name in scores:
        budget = None if name == "full" else name.rsplit("@", 1)[-1]
        lines.append({"kind": "policy", "policy": name, "method": name.split("@")[0], "budget": budget,
                      "role": "full" if name == "full" else roles.get(name, ""),
                      "plan": (plans or {}).get(name), "nominal_bytes": None, **(policy_extra or {}).get(name, {})})
    for name, values in scores.items():
        for i, s in enumerate(values):
            lines.append({"kind": "result", "policy": name, "task": task, "item": f"{task}-{i}", "score": s,
                          "kv_bytes": 1000 if name == "full" else 125, "full_kv_bytes": 1000,
                          "context_tokens": context, **((extra or {}).get(name, [{}] * len(values))[i])})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _report(tmp_path, path, **kw) -> str:
    write_report(path, str(tmp_path / "out"), **kw)
    return (tmp_path / "out" / "report.md").read_text()


def test_one_item_claims_nothing(tmp_path):
    path = write_results(tmp_path / "r.jsonl", {"full": [1.0], "a@8x": [1.0], "b@8x": [0.0]})
    md = _report(tmp_path, path)
    head = md.split("## Glossary")[0]
    assert "## Conclusion" in head
    assert "No plan is distinguishable from another with n = 1 item(s): a difference at 95% needs at least 6" in head
    assert "differs" not in md and "] *" not in md
    res = Results.load(path)
    iv = designs.paired_vs(res, "passkey", "a@8x", "b@8x")
    assert iv.low == iv.high == 1.0  # the degenerate interval a bootstrap over one item gives
    assert not distinguishable(iv, res.scores("a@8x", "passkey"), res.scores("b@8x", "passkey"))


def test_identical_answers_claim_nothing(tmp_path):
    path = write_results(tmp_path / "r.jsonl", {"full": [1.0] * 20, "a@8x": [1.0] * 20, "b@8x": [1.0] * 20})
    md = _report(tmp_path, path)
    assert "No plan is distinguishable from another at 95% with n = 20 items; every plan scored the same on " \
           "every item" in md
    assert "differs" not in md and "] *" not in md


def test_few_disagreeing_items_among_many_are_not_a_difference(tmp_path):
    # 5 of 100 items disagree, all one way: a bootstrap interval excludes 0, the sign test over 5 items cannot
    a, b = [1.0] * 100, [1.0] * 95 + [0.0] * 5
    path = write_results(tmp_path / "r.jsonl", {"a@8x": a, "b@8x": b})
    res = Results.load(path)
    iv = designs.paired_vs(res, "passkey", "a@8x", "b@8x")
    assert iv.excludes_zero() and iv.shows_difference()
    assert discordant(np.array(a), np.array(b)) == 5 and not distinguishable(iv, np.array(a), np.array(b))
    md = _report(tmp_path, path)
    assert "] *" not in md and "distinguishable at 95% from" not in md
    need = items_needed(iv)
    assert f"would need about {need} items to resolve" in md and need >= 6


def test_a_clear_winner_is_named_with_its_interval_against_full(tmp_path):
    scores = {"full": [1.0] * 30, "a@8x": [1.0] * 28 + [0.0] * 2, "b@8x": [0.0] * 30,
              "a@4x": [1.0] * 30, "b@4x": [1.0] * 30}
    path = write_results(tmp_path / "r.jsonl", scores)
    res = Results.load(path)
    s8 = budget_conclusion(res, "passkey", "8x", name=str)
    iv = designs.paired_vs(res, "passkey", "a@8x", "full")
    assert s8.startswith("At 8x, a@8x scores highest: 93.3% [")
    assert f"against the full cache {iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]" in s8
    assert "no difference from the full cache at 95%" in s8
    assert s8.endswith("it is distinguishable at 95% from b@8x.")
    s4 = budget_conclusion(res, "passkey", "4x", name=str)
    assert "tied highest: a@4x, b@4x" in s4
    md = _report(tmp_path, path)
    assert "- `passkey`: At 8x, a@8x scores highest" not in md  # Markdown names are escaped text, not code spans
    assert "- passkey: At 8x, a@8x scores highest" in md
    assert md.index("## Conclusion") < md.index("## Glossary") < md.index("## Task")
    star = [ln for ln in md.splitlines() if ln.startswith("| a@8x | b@8x |")]
    assert star and star[0].split("|")[3].rstrip().endswith("*")


def test_the_demo_prints_the_reports_conclusion(tmp_path, capsys):
    path = write_results(tmp_path / "r.jsonl", {"full": [1.0] * 8, "a@8x": [1.0] * 8, "b@8x": [0.0] * 8})
    print_table(path)
    out = capsys.readouterr().out
    want = conclusion_text(Results.load(path))
    assert want and "\nConclusion:\n" + "".join(f"- {s}\n" for s in want) in out
    assert "b@8x - full: -1.00 [-1.00, -1.00] (differs from the full cache at 95%)" in out


def test_the_demo_says_too_few_items_instead_of_differs(tmp_path, capsys):
    path = write_results(tmp_path / "r.jsonl", {"full": [1.0] * 3, "a@8x": [0.0] * 3})
    print_table(path)
    out = capsys.readouterr().out
    assert "too few items to tell at 95%: 3 of 3 item(s) disagree, a difference needs at least 6" in out
    assert "differs" not in out


def test_glossary_defines_the_designs_from_the_code(small_study):
    _, results, _ = small_study
    terms = dict(glossary(Results.load(results)))
    assert terms["full"].startswith("the full cache")
    assert terms["2d_hetero"].startswith("solver `exact`: Optimal multiple-choice knapsack.")
    assert terms["route"].startswith("solver `profile-route`")
    assert "PolyKV's routing of the rule's identity per layer" in terms["route"]
    assert "Role `routed_uniform`" in terms["route"]


def test_glossary_names_the_chain_contrasts(tmp_path):
    roles = {"u@8x": "2d_uniform", "q@8x": "2d", "h@8x": "2d_hetero"}
    path = write_results(tmp_path / "r.jsonl", {n: [1.0, 0.0, 1.0] for n in roles}, roles=roles)
    terms = dict(glossary(Results.load(path)))
    assert terms["d_quant"].startswith("2d - 2d_uniform") and terms["d_evict"].startswith("2d_hetero - 2d")
    assert "MoE-nD's `2d_uniform`" in terms["u"]
    md = _report(tmp_path, path)
    assert "- **d_quant**: 2d - 2d_uniform: what per-layer K/V widths add at one keep" in md
    assert "hetero_vs_1d" not in terms and "hetero_vs_full" not in terms  # no 1d, no full cache in this study
    assert "2d_uniform" not in terms  # the role is defined under the policy that plays it


def _placements(tmp_path, kl_guided=0.1):
    """A guided route and 9 random placements over 6 items, with KL recorded (teacher-forced)."""
    names = ["route@8x"] + [f"random#{i}@8x" for i in range(9)]
    rng = np.random.default_rng(0)
    scores = {n: [float(x) for x in rng.random(6) < 0.5] for n in names}
    kl = {n: kl_guided if n == "route@8x" else 0.2 + 0.01 * i for i, n in enumerate(names)}
    extra = {n: [{"kl": kl[n], "kl_max": 1.0, "top1": scores[n][i], "ppl": 2.0, "ppl_full": 2.0, "positions": 4}
                 for i in range(6)] for n in names}
    policy_extra = {n: {"guided": "route", "index": None if n == "route@8x" else i - 1,
                        "profile_score": float(-kl[n])} for i, n in enumerate(names)}
    roles = {n: "placement" for n in names[1:]}
    return write_results(tmp_path / "r.jsonl", scores, roles=roles, task="continuation", extra=extra,
                         policy_extra=policy_extra), kl


def test_placement_ranks_on_kl_when_asked_and_draws_the_distribution(tmp_path):
    path, kl = _placements(tmp_path)
    res = Results.load(path)
    pl = designs.placement(res, "continuation", "8x", metric="kl")
    assert pl["control"].rank == 1 and np.isclose(pl["control"].guided, kl["route@8x"]) and not pl["higher_is_better"]
    assert pl["spearman"].r == -1.0  # predicted loss -S ranks the measured score (-KL) exactly: negative
    md = _report(tmp_path, path, placement_metric="kl")
    assert "**Placement control** (ranked on mean KL (full || policy)" in md and "rank 1 of 10" in md
    assert "![placement control at 8x](continuation-placement-8x.png)" in md
    assert (tmp_path / "out" / "continuation-placement-8x.png").is_file()
    assert f"{predicted.SPEARMAN_CONVENTION}; predicted loss the route's sign-flipped profile score -S, measured " \
           "score the negated mean KL, over 10 routes: -1.000" in md


def test_placement_on_kl_without_kl_falls_back_to_top1_and_says_so(tmp_path):
    names = ["route@8x", "random#0@8x", "random#1@8x"]
    path = write_results(tmp_path / "r.jsonl", {n: [1.0, 0.0] for n in names},
                         roles={n: "placement" for n in names[1:]},
                         policy_extra={n: {"guided": "route", "index": None if i == 0 else i - 1}
                                       for i, n in enumerate(names)})
    assert designs.placement(Results.load(path), "passkey", "8x", metric="kl") is None
    md = _report(tmp_path, path, placement_metric="kl")
    assert "measured no KL: the placements are ranked on top-1 instead" in md
    assert "(ranked on top-1 score" in md


def test_a_plan_file_named_for_a_budget_competes_at_that_budget(tmp_path):
    # the demo lists its shipped kvzip-global plans as "kvzip-global@8x": plan files, no solver budget, the budget
    # in their provenance
    scores = {"full": [1.0] * 8, "kvzip-global@8x": [1.0] * 8, "joint@8x": [0.0] * 8}
    plan = {"provenance": {"budget": {"ratio": 8.0}}}
    path = write_results(tmp_path / "r.jsonl", scores, policy_extra={"kvzip-global@8x": {"budget": None,
                                                                                         "plan": plan}})
    res = Results.load(path)
    assert designs.plans_at(res, "8x") == ["kvzip-global@8x", "joint@8x"] and designs.budgets(res) == ["8x"]
    s = budget_conclusion(res, "passkey", "8x", name=str)
    assert s.startswith("At 8x, kvzip-global@8x scores highest") and s.endswith("from joint@8x.")
