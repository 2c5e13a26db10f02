"""``polykv report``: a Markdown report and its figures (PNG, SVG or PDF) from a study's results file.

The report opens with its conclusion per task and budget and a glossary of the design names it uses
(:mod:`polykv.studies.conclusion`). Every accuracy carries a Wilson 95% interval; every difference between
two policies is a paired bootstrap interval over the same items (10,000 seeded replicates), starred only
when enough items differ to show it. Measured bytes the cache holds after compressing the context (K/V
stores with scales, minima and residuals, plus metadata: positions and rule state) stand beside every score,
with the ratio against a 16-bit full cache of the same contexts. Paired comparisons at one budget carry a
warning when the two policies' measured bytes differ by more than 5%
(:data:`polykv.studies.designs.BYTES_TOLERANCE`). Sections appear when the study has the policies they need:
MoE-nD's ablation chain, PolyKV's factorial, the placement control with its figure and the profile-score
Spearman, the Spearman of profile-predicted loss against accuracy at each budget (every correlation in one
sign convention, :data:`polykv.studies.predicted.SPEARMAN_CONVENTION`), and the fixed-route budget sweep
(see :mod:`polykv.studies.designs`). Teacher-forced tasks (``continuation``) score the top-1 agreement with
the full cache and add a table of KL and perplexity.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from polykv.atomic import check_output, write_text_atomic
from polykv.errors import OutputError
from polykv.memory import context_note, memory_report
from polykv.plan.io import parse_plan_dict
from polykv.profiling.profile import load_profile
from polykv.strict_json import check_readable_file
from polykv.studies import designs, plots, predicted, stats
from polykv.profiling import stats as paired_stats
from polykv.studies.combine import combine_results
from polykv.studies.conclusion import backed, conclusion_markdown, glossary_markdown, varying
from polykv.studies.figures import Figures
from polykv.studies.markdown import cell, code, line
from polykv.studies.options import DEFAULT_DPI, check_placement_metric
from polykv.studies.results import Results
from polykv.studies.routes import route_rows


def _pct(iv: paired_stats.Interval) -> str:
    return f"{iv.estimate:.1%} [{iv.low:.1%}, {iv.high:.1%}]"


def _diff(iv: paired_stats.Interval, differing: int) -> str:
    """The interval, starred when it shows a difference backed by enough differing items (:func:`backed`)."""
    mark = " *" if backed(iv, differing) else ""
    return f"{iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]{mark}"


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.3f}"


def policy_rows(res: Results, task: str) -> list[dict[str, Any]]:
    """Per policy: accuracy interval, measured bytes and ratios (the main table)."""
    rows = []
    items = res.items(task)
    for name in res.policy_names():
        rec = res.policies[name]
        scores = res.scores(name, task, items) if items else np.array([])
        if not scores.size:
            continue
        k, n = int(round(scores.sum())), int(scores.size)
        held = designs.mean_held_bytes(res, name, task)
        full = designs.mean_full16_bytes(res, name, task)
        rows.append({"policy": name, "method": rec.get("method"), "budget": rec.get("budget"),
                     "role": rec.get("role"), "k": k, "n": n, "mean": float(scores.mean()),
                     "binary": bool(np.all((scores == 0) | (scores == 1))),
                     "wilson": paired_stats.wilson_interval(k, n) if np.all((scores == 0) | (scores == 1)) else None,
                     "bytes": held, "kv_bytes": designs.mean_bytes(res, name, task),
                     "ratio": full / held if held else float("inf"),
                     "nominal": rec.get("nominal_bytes"), "full16": rec.get("full_bytes_16bit"),
                     "predicted": rec.get("predicted_held_bytes_16bit"), "basis": rec.get("basis"),
                     "expected_ratio": _expected_ratio(res, rec), "full_bytes": full})
    return rows


def _expected_ratio(res: Results, rec: dict) -> float | None:
    """An allocator plan's expected ratio against a 16-bit full cache (every allocated layer at its planned
    capacity, :attr:`polykv.memory.MemoryReport.expected_ratio`) at the study's context; None for other plans."""
    if not rec.get("plan") or not rec["plan"].get("allocation"):
        return None
    plan = parse_plan_dict(rec["plan"], source=f"{res.path}: policy '{rec.get('policy')}'")
    T = int(res.header["spec"].get("context_tokens") or 0)
    return memory_report(plan, plan.model, T).expected_ratio if T > 0 and plan.model is not None else None


def _table(rows: list[dict]) -> list[str]:
    out = ["| policy | budget | role | items | accuracy [Wilson 95%] | measured MiB (with metadata) "
           "| measured ratio vs 16-bit full | predicted resident ratio | nominal ratio | budget basis |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = _pct(r["wilson"]) if r["wilson"] is not None else f"{r['mean']:.3f}"
        nom = f"{r['full16'] / r['nominal']:.2f}x" if r.get("nominal") else "-"
        pred = f"{r['full16'] / r['predicted']:.2f}x" if r.get("predicted") and r.get("full16") else "-"
        if r.get("expected_ratio"):
            pred = f"bound {pred}, expected {r['expected_ratio']:.2f}x"
        out.append(f"| {cell(r['policy'])} | {cell(r['budget'] or '-')} | {cell(r['role'] or '-')} | {r['n']} | "
                   f"{acc} | {_mib(r['bytes'])} | {r['ratio']:.2f}x | {pred} | {nom} | {cell(r.get('basis') or '-')} |")
    return out


def _context_notes(res: Results, task: str) -> list[str]:
    """One line per policy whose plan keeps absolute capacities budgeted for another context length."""
    out = []
    for name, rec in res.policies.items():
        if not rec.get("plan"):
            continue
        T = [r["context_tokens"] for r in res.results if r["policy"] == name and r["task"] == task]
        if not T:
            continue
        plan = parse_plan_dict(rec["plan"], source=f"{res.path}: policy '{name}'")
        mean_T = int(round(float(np.mean(T))))
        note = context_note(plan, mean_T)
        solved_at = plan.provenance.context_tokens
        if note:
            out.append(f"- {code(name)}: {note} (mean context of the items)")
        elif solved_at and int(solved_at) != mean_T:
            out.append(f"- {code(name)}: solved for a {int(solved_at):,}-token context (its provenance budget), run "
                       f"on {mean_T:,} tokens (mean context of the items): its predicted loss refers to the other "
                       f"length")
    return (["Context length:"] + out + [""]) if out else []


def fidelity_rows(res: Results, task: str) -> list[dict[str, Any]]:
    """Per policy of a teacher-forced task, means over the paired items of top-1 agreement, KL and perplexity.

    Empty when ``task``'s records carry no ``kl`` (a generate task).
    """
    items = set(res.items(task))
    rows = []
    for name in res.policy_names():
        recs = [r for r in res.results if r["policy"] == name and r["task"] == task and r["item"] in items]
        if not recs or any("kl" not in r for r in recs):
            continue
        mean = {k: float(np.mean([r[k] for r in recs])) for k in ("top1", "kl", "kl_max", "ppl", "ppl_full")}
        rows.append({"policy": name, "budget": res.policies[name].get("budget"), "n": len(recs), **mean,
                     "positions": int(sum(r["positions"] for r in recs)),
                     "bytes": designs.mean_held_bytes(res, name, task)})
    return rows


def _fidelity_table(rows: list[dict]) -> list[str]:
    out = ["Teacher-forced continuation: means over items of the per-item means over continuation positions. "
           "The accuracy column above is the top-1 agreement with the full cache; KL(full || policy) is in nats; "
           "ppl is the policy's perplexity of the reference continuation, full ppl the full cache's on the same "
           "positions.", "",
           "| policy | budget | items | positions | top-1 agreement | mean KL | max KL (mean over items) | ppl | "
           "full ppl | measured MiB (with metadata) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {cell(r['policy'])} | {cell(r['budget'] or '-')} | {r['n']} | {r['positions']} | "
                   f"{r['top1']:.3f} | "
                   f"{r['kl']:.4f} | {r['kl_max']:.3f} | {r['ppl']:.2f} | {r['ppl_full']:.2f} | "
                   f"{_mib(r['bytes'])} |")
    return out


def _pairs(res: Results, task: str, budget: str) -> list[str]:
    names = designs.plans_at(res, budget)
    if "full" in res.policies:
        names.append("full")
    out = ["| A | B | mean(A) - mean(B) [paired bootstrap 95%] | bytes A / bytes B |", "|---|---|---|---|"]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            iv = designs.paired_vs(res, task, a, b)
            ratio = designs.mean_held_bytes(res, a, task) / designs.mean_held_bytes(res, b, task)
            flag = " (!)" if b != "full" and abs(ratio - 1) > designs.BYTES_TOLERANCE else ""
            out.append(f"| {cell(a)} | {cell(b)} | {_diff(iv, varying(res.scores(a, task), res.scores(b, task)))} | "
                       f"{ratio:.2f}{flag} |")
    compared = [n for n in names if n != "full"]
    warnings = designs.unequal_memory(res, task, compared)
    if warnings:
        out += ["", f"(!) Warning: {len(warnings)} pair(s) at this budget differ by more than "
                    f"{designs.BYTES_TOLERANCE:.0%} in measured bytes:"] + [f"- {line(w)}" for w in warnings]
    return out


MATCHED = 1.25
"""Two policies count as memory-matched when their mean measured bytes differ by at most this factor."""


def _matched(res: Results, task: str) -> list[str]:
    """Paired intervals of every two policies (any budget) whose measured KV bytes are within MATCHED."""
    names = [n for n, r in res.policies.items() if r.get("role") not in ("placement", "full")]
    kv = {n: designs.mean_held_bytes(res, n, task) for n in names}
    out = ["| A | B | bytes A / bytes B | mean(A) - mean(B) [paired bootstrap 95%] |", "|---|---|---|---|"]
    rows = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ratio = kv[a] / kv[b]
            budget = res.policies[a].get("budget")
            listed = budget is not None and budget == res.policies[b].get("budget")  # in the per-budget table
            if 1 / MATCHED <= ratio <= MATCHED and not listed:
                differing = varying(res.scores(a, task), res.scores(b, task))
                iv = designs.paired_vs(res, task, a, b)
                out.append(f"| {cell(a)} | {cell(b)} | {ratio:.2f} | {_diff(iv, differing)} |")
                rows += 1
    return out if rows else []


def _intervals(title: str, policies: dict[str, str], intervals: dict[str, paired_stats.Interval], differing: int
               ) -> list[str]:
    """A design's contrasts; ``differing``: items on which its policies' scores are not all equal (a star needs
    enough of them)."""
    out = [f"**{title}** — policies: " + ", ".join(f"{cell(k)} = {code(v)}" for k, v in policies.items()), "",
           "| contrast | estimate [95% interval] | bootstrap p |", "|---|---|---|"]
    for name, iv in intervals.items():
        p = "-" if iv.p_value is None else f"{iv.p_value:.3f}"
        out.append(f"| {cell(name)} | {_diff(iv, differing)} | {p} |")
    return out + [""]


def _optimality(rows: list[dict]) -> list[str]:
    """Each solver's predicted loss (additive model) beside the exact optimum at the same budget."""
    if not rows:
        return []
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    out = ["**Predicted loss vs the exact optimum** (the profile's additive loss model; the exact optimum is the "
           "multiple-choice knapsack over the same rules, any per-layer mix, at the same budget):", "",
           "| policy | solver | rules | predicted loss | exact, same rules | gap | exact, all rules |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["gap"] is None else f"{r['gap']:+.1%}"
        rules = ", ".join(r["rules"]) if r["rules"] else "all"
        if r.get("skipped"):
            out.append(f"| {cell(r['policy'])} | {cell(r['solver'])} | {cell(rules)} | {f(r['loss'])} | "
                       f"skipped: {cell(r['skipped'])} | - | - |")
            continue
        out.append(f"| {cell(r['policy'])} | {cell(r['solver'])} | {cell(rules)} | "
                   f"{f(r['loss'])} | {f(r['exact_same_rules'])} | {gap} | {f(r['exact_all_rules'])} |")
    return out + [""]


def _predicted_vs_measured(pvm: dict | None) -> list[str]:
    """Spearman of the profile-predicted loss against the accuracy of the plans at one budget, and its rows."""
    if pvm is None:
        return []
    n, sp = pvm["n"], pvm["spearman"]
    few = (f" (n = {n} < {predicted.PREDICTED_VS_MEASURED_MIN}: fewer plans than this check needs to count as "
           f"evidence)" if n < predicted.PREDICTED_VS_MEASURED_MIN else "")
    head = (f"**Predicted vs measured** — {predicted.SPEARMAN_CONVENTION}; predicted loss from the profile, "
            f"measured score the accuracy, over n = {n} plans: " + (
                f"{sp.r:+.3f} (one-sided permutation p = {sp.p_value:.3f})" if sp is not None
                else f"undefined ({line(pvm['note'])})") + few)
    out = [head, "", "| policy | solver | predicted loss | from | accuracy |", "|---|---|---|---|---|"]
    for r in sorted(pvm["rows"], key=lambda r: (r["loss"] is None, r["loss"] or 0.0, r["policy"])):
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        source = cell(r["source"] or "not in the profile")
        if r.get("same_plan_as"):
            source += f"; the same plan as {cell(r['same_plan_as'])}, counted once"
        out.append(f"| {cell(r['policy'])} | {cell(r['solver'] or '-')} | {loss} | {source} | {r['accuracy']:.3f} |")
    return out + [""]


def _line(method: str, budget: str) -> str:
    """The line of the score-vs-memory plot a policy belongs to: its spec entry, a plan file listed as ``NAME@B``
    (one per budget, like the demo's ``kvzip-global@8x``) on the line ``NAME``."""
    return method[:-len(budget) - 1] if method.endswith(f"@{budget}") else method


def _task_section(res: Results, task: str, figures: Figures, profile=None, placement_metric: str = "top-1"
                  ) -> list[str]:
    rows = policy_rows(res, task)
    lines = [f"## Task {code(task)} ({len(res.items(task))} paired items)", ""] + _table(rows) + [""]
    lines += _context_notes(res, task)
    forced = fidelity_rows(res, task)
    if forced:
        lines += _fidelity_table(forced) + [""]
    full = next((r for r in rows if r["policy"] == "full"), None)
    points = [{**r, "method": _line(r["method"] or r["policy"], r["budget"])} for r in rows
              if r["budget"] is not None and r["role"] != "placement" and r["binary"]]
    if points:
        fig = figures.add(f"{task}-score-vs-memory", lambda path: plots.score_vs_memory(
            points, path, title=f"{task}: accuracy vs measured KV memory",
            full=full if full and full["binary"] else None))
        lines += [f"![score vs memory]({fig})", ""]
    matched = _matched(res, task)
    if matched:
        lines += [f"### Across budgets at matched measured memory (within {MATCHED:g}x)", ""] + matched + [""]
    for b in designs.budgets(res):
        lines += [f"### Budget {cell(b)}", "", "Paired differences (`*`: the interval excludes 0 and at least "
                  f"{paired_stats.min_units_for_difference()} items differ, the fewest that can show a difference at 95%):",
                  ""]
        lines += _pairs(res, task, b) + [""]
        chain = designs.moend_chain(res, task, b)
        if chain:
            lines += _intervals("MoE-nD ablation chain (d_quant = 2d - 2d_uniform, d_evict = 2d_hetero - 2d)",
                                chain["policies"], chain["intervals"],
                                varying(*(res.scores(n, task) for n in chain["policies"].values())))
            warn = designs.unequal_memory(res, task, [v for k, v in chain["policies"].items() if k != "full"])
            lines += ([f"(!) The chain compares unequal memory: {line(w)}" for w in warn] + [""]) if warn else []
        if profile is not None:
            lines += _optimality(predicted.loss_vs_exact(res, b, profile))
        lines += _predicted_vs_measured(predicted.predicted_vs_measured(res, task, b, profile))
        fact = designs.factorial(res, task, b)
        if fact:
            lines += _intervals("PolyKV factorial (homogeneous | routed) x (uniform | allocated)",
                                fact["policies"], fact["intervals"],
                                varying(*(res.scores(n, task) for n in fact["policies"].values())))
        lines += _placement(res, task, b, figures, placement_metric)
    sweeps = designs.budget_sweep(res, task)
    for method, pts in sweeps.items():
        lines += [f"### Fixed-route budget sweep: {code(method)}", "",
                  "| budget | accuracy | measured MiB (with metadata) |",
                  "|---|---|---|"]
        for b, name in pts:
            r = next(x for x in rows if x["policy"] == name)
            acc = _pct(r["wilson"]) if r["wilson"] is not None else f"{r['mean']:.3f}"
            lines.append(f"| {cell(b)} | {acc} | {_mib(r['bytes'])} |")
        lines.append("")
    return lines


def _placement(res: Results, task: str, budget: str, figures: Figures, metric: str) -> list[str]:
    """PolyKV's placement control at ``budget``: rank, figure of the random placements' scores, and the Spearman of
    the profile's prediction, ranked on ``metric`` (a task that measured no KL falls back to top-1, said so)."""
    pl = designs.placement(res, task, budget, metric=metric)
    said = []
    if pl is None and metric != "top-1":
        pl = designs.placement(res, task, budget)
        said = [f"(Task {code(task)} measured no KL: the placements are ranked on top-1 instead.)", ""] if pl else []
    if pl is None:
        return []
    c, what = pl["control"], ("mean KL (full || policy)" if pl["metric"] == "kl" else "top-1 score")
    fig = figures.add(f"{task}-placement-{budget}", lambda path: plots.placement_distribution(
        [v for n, v in pl["mean_scores"].items() if n != pl["guided"]], c.guided, path, metric=what,
        higher_is_better=pl["higher_is_better"], title=f"{task} at {budget}: guided route vs random placements"))
    lines = said + [f"**Placement control** (ranked on {what}; `--placement-metric`) — guided {code(pl['guided'])} "
                    f"scores {c.guided:.3f}; rank {c.rank} of {c.total} among count-matched random placements (mean "
                    f"{c.random_mean:.3f}); one-sided Monte Carlo p = {c.p_value:.3f}.", "",
                    f"![placement control at {cell(budget)}]({fig})", ""]
    sp = pl["spearman"]
    measured = "the negated mean KL" if pl["metric"] == "kl" else "the top-1 score"
    return lines + [f"**Profile validation** — {predicted.SPEARMAN_CONVENTION}; predicted loss the route's "
                    f"sign-flipped profile score -S, measured score {measured}, over {len(pl['profile_scores'])} routes: "
                    + (f"{sp.r:+.3f}, one-sided permutation p = {sp.p_value:.3f}" if sp is not None else
                       f"undefined ({line(pl['spearman_note'])})"), ""]


def prompt_line(res: Results) -> str:
    """How the prompts began: the spec's ``prompt_format`` and ``bos``, and how many items' first stored
    token was the BOS (recorded per result; older results files recorded nothing)."""
    spec = res.header["spec"]
    if "bos" not in spec:
        return "Prompt: plain completion, no special tokens (written before the prompt rule was recorded)."
    firsts = {(r["task"], r["item"]): r["bos_first"] for r in res.results if "bos_first" in r}
    bos = {True: "true", False: "false"}.get(spec["bos"], spec["bos"])
    return (f"Prompt: {code(spec.get('prompt_format', 'plain'))} format, `bos`: {code(bos)}; the first stored token is "
            f"the tokenizer's BOS in {sum(firsts.values())} of {len(firsts)} items.")


def is_report_file(path: str) -> bool:
    """True when ``path`` is a report.md written by :func:`write_report` (it starts with ``# Study ``)."""
    with open(path, "rb") as fh:
        return fh.read(9) == b"# Study `"


def check_report_folder(out_dir: str, option: str, inputs=()) -> None:
    """Refuse a report folder that is an input, a file, or holds a report.md polykv did not write."""
    check_output(out_dir, what="report folder", option=option, inputs=[p for p in inputs if p], folder=True)
    check_output(os.path.join(out_dir, "report.md"), what="report", option=option, recognise=is_report_file,
                 inputs=[p for p in inputs if p])


def write_report(results_path: str | Sequence[str], out_dir: str, *, profile_path: str | None = None,
                 option: str = "report folder", formats: Sequence[str] = ("png",), dpi: int = DEFAULT_DPI,
                 placement_metric: str = "top-1") -> list[str]:
    """Write ``report.md`` and its figures into ``out_dir``; return the paths written.

    The report opens with its conclusion (:mod:`polykv.studies.conclusion`) and a glossary of the design names it
    uses. Each figure is written in every format of ``formats`` (png, svg, pdf) at ``dpi``; the placement control
    ranks on ``placement_metric`` (:data:`polykv.studies.options.PLACEMENT_METRICS`).

    ``results_path`` may name several results files: parts of one experiment, reported together
    (:func:`polykv.studies.combine.combine_results` says when parts combine).

    Nothing is written unless every output is safe to write: ``report.md`` and each figure is either
    absent or a file an earlier report wrote (``option`` names the folder's option in the message).
    """
    paths = [results_path] if isinstance(results_path, str) else list(results_path)
    check_report_folder(out_dir, option, inputs=[*paths, profile_path])
    res = combine_results(paths)
    results_path = res.path
    spec = res.header["spec"]
    figures = Figures(out_dir, formats, dpi)
    check_placement_metric(placement_metric)
    lines = [f"# Study {code(spec.get('name'))}", "",
             f"Results: {code(results_path)} (spec hash {code(res.header['spec_hash'])}); model: "
             f"{code(spec.get('model'))} ({cell(spec.get('dtype'))}); budgets refer to a "
             f"{spec.get('context_tokens')}-token context.", "",
             f"Cache storage dtype: {cell(spec.get('storage_dtype') or spec.get('dtype'))}; solver budgets counted on "
             f"the {cell(spec.get('basis', 'nominal'))} basis.", "",
             "Protocol: the context is prefilled and compressed by the policy, then the question is fed through "
             "the compressed cache, then the answer is generated greedily. Measured bytes are what the cache holds "
             "after compressing the context: key/value stores (codes, scales, minima, full-precision residuals) "
             "plus metadata (positions, rule state), in the run's storage dtype; ratios are against a 16-bit full "
             "cache of the same context. The predicted resident ratio is the memory model's (16-bit storage, "
             "metadata included); the nominal ratio is MoE-nD's codes-only formula. Teacher-forced tasks feed the "
             "reference continuation instead, one token per forward, and compare each next-token distribution with "
             "the full cache's.", "", prompt_line(res), "", *conclusion_markdown(res), *glossary_markdown(res)]
    prof = None
    if profile_path is not None:  # asked for: it must be there
        try:
            check_readable_file(profile_path, "profile (--profile)")
        except OutputError as exc:
            raise OutputError(f"--profile {exc}") from None
    else:  # the study's own profile, when it is still where the study read it
        profile_path = spec.get("profile")
        profile_path = profile_path if profile_path and os.path.isfile(profile_path) else None
    if profile_path is not None:
        prof = load_profile(profile_path)
    for task in res.tasks:
        lines += _task_section(res.for_task(task), task, figures, prof, placement_metric)
    for b in designs.budgets(res):
        rows, T = route_rows(res, b)
        if rows:
            fig = figures.add(f"routes-{b}", lambda path, rows=rows, T=T, b=b: plots.route_strip(
                rows, path, context_tokens=T, title=f"per-layer plans at budget {b} (T = {T})"))
            lines += [f"![routes at {cell(b)}]({fig})", ""]
    if prof is not None:
        stat = None
        if prof.stats:
            name = "cosine" if "cosine" in prof.stats else sorted(prof.stats)[0]
            st = prof.stats[name]
            stat = (st.values, st.columns, f"stats.{name}")
        fig = figures.add("sensitivity", lambda path: plots.sensitivity_heatmap(
            prof.table(), [c.label for c in prof.configs], path,
            title=f"profile {prof.fingerprint}: metric '{prof.default_metric}'", stat=stat))
        lines += ["## Profile", "", f"![sensitivity heatmap]({fig})", ""]
    figures.check(option, inputs=[p for p in (*paths, profile_path) if p])
    os.makedirs(out_dir, exist_ok=True)
    drawn = figures.draw()
    md = os.path.join(out_dir, "report.md")
    write_text_atomic(md, "\n".join(lines) + "\n")
    return [md] + drawn
