"""``polykv demo``: MoE-nD's ablation chain and a PolyKV rule route on SmolLM2, passkey, two budgets.

The demo is a study (``examples/demo_study.json`` is the same spec): on the default model with the
shipped profile it solves ``1d``, ``2d_uniform``, ``2d`` (quant-only), ``2d_hetero`` (MoE-nD greedy),
``route`` (PolyKV profile route, 16 bits) and ``joint`` (exact knapsack over every profiled rule,
keep and K/V width), beside the shipped ``kvzip-global`` plan (:data:`KVZIP_PLANS`), at 8x and 4x
compression of the bytes the cache really holds (resident basis: codes, scales, residuals and metadata,
stored in bfloat16 while the model computes in float32), runs passkey retrieval (compress the context, feed
the question through the compressed cache, generate greedily), prints accuracy with Wilson intervals,
measured bytes with metadata and their ratio against a 16-bit full cache, each solver's predicted loss
beside the exact optimum and the report's conclusion (:mod:`polykv.studies.conclusion`, the same sentences
``report.md`` opens with), and writes the report. Running it again resumes an interrupted run.

The study machinery, the runtime and matplotlib are imported when the verb runs, not when the command line
starts (every verb's module is imported then).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

from polykv.atomic import check_output, write_text_atomic
from polykv.errors import StudyError
from polykv.strict_json import read_json_head

PROFILE_NAME = "smollm2-135m-instruct.profile.json"
"""The shipped profile of the default model, in the repository's ``profiles/`` folder."""
PROFILE_NAMES = {"smollm2-135m": PROFILE_NAME, "gemma3-270m": "gemma3-270m.profile.json"}
"""The shipped profile of each named model."""

KVZIP_PLANS = {"smollm2-135m": "kvzip-global.{budget}.plan.json", "gemma3-270m": "gemma3-270m.kvzip-global.{budget}.plan.json"}
"""The shipped ``kvzip-global`` plan of each named model at a budget (resident basis, bfloat16 storage, 2,048
tokens), in the checkout's ``bench/high_compression/plans/``: one KVzip ranking over layers x KV heads, made by
``bench/high_compression/make_kvzip_plans.py``. The demo runs it at each of its budgets that has one."""
KVZIP_FOLDER = ("bench", "high_compression", "plans")

CHAIN_RULE = "snapkv"
"""The one eviction rule of the MoE-nD chain (1d ... 2d_hetero), so the chain isolates bits and keeps."""

DEMO_SPEC = {
    "name": "demo",
    "model": "default",
    "dtype": "float32",
    "storage_dtype": "bfloat16",
    "basis": "resident",
    "context_tokens": 2048,
    "profile": f"../profiles/{PROFILE_NAME}",
    "budgets": ["8x", "4x"],
    "baseline": True,
    "solvers": [
        {"name": "1d", "solver": "uniform", "params": {"mode": "1d", "rule": CHAIN_RULE}},
        {"name": "2d_uniform", "solver": "uniform", "params": {"mode": "2d_uniform", "rule": CHAIN_RULE}},
        {"name": "2d", "solver": "quant-only", "params": {"rule": CHAIN_RULE}},
        {"name": "2d_hetero", "solver": "moend-greedy", "params": {"rule": CHAIN_RULE}},
        {"name": "route", "solver": "profile-route", "params": {"scope": "prefill"}, "role": "routed_uniform"},
        {"name": "joint", "solver": "exact", "params": {}},
    ],
    "plans": {f"kvzip-global@{b}": "../" + "/".join(KVZIP_FOLDER) + "/" + KVZIP_PLANS["smollm2-135m"].format(budget=b)
              for b in ("8x", "4x")},
    "tasks": [{"task": "passkey", "params": {"length": 2048}, "samples": 20, "seed": 0}],
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="run the MoE-nD chain and a PolyKV route on SmolLM2 (passkey, 8x and 4x) and write a report",
        description="Solve 1d, 2d_uniform, 2d, 2d_hetero, a profile route and the joint exact plan at 8x and 4x "
                    "compression from the shipped SmolLM2 profile, beside the shipped kvzip-global plan (one KVzip "
                    "ranking over layers x heads) at each budget that has one, run passkey retrieval on each (context "
                    "compressed, then the question fed through the compressed cache), print accuracy with Wilson "
                    "intervals beside measured KV bytes, and write the report. Resumes when run again.")
    p.add_argument("--samples", type=int, default=20, metavar="N", help="passkey items per policy (default 20)")
    p.add_argument("--budgets", nargs="+", default=None, metavar="B",
                   help="compression budgets on the resident basis (default: 8x 4x), e.g. --budgets 10x 12x 14x")
    p.add_argument("--basis", choices=("resident", "nominal"), default="resident",
                   help="what the budgets count: resident bytes (default; metadata included) or MoE-nD's nominal "
                        "codes-only bytes")
    p.add_argument("--out", default=os.path.join("results", "demo"), metavar="DIR",
                   help="output folder: spec.json, results.jsonl, report.md, figures (default results/demo)")
    p.add_argument("--model", default="default", metavar="NAME",
                   help=f"named model to run: {', '.join(sorted(PROFILE_NAMES))} (default: the default model, "
                        f"smollm2-135m)")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile of the model (default: its shipped profile in profiles/ of this checkout, "
                        f"e.g. {PROFILE_NAME})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice); 1 is fastest on a machine shared with "
                        "other busy processes")
    p.set_defaults(func=run)


def find_profile(given: str | None, model: str = "default") -> str:
    """The profile to use: ``given``, else the model's shipped one (checkout's ``profiles/``, then ./profiles)."""
    if given is not None:
        if not os.path.isfile(given):
            raise StudyError(f"--profile {given}: no such file")
        return os.path.abspath(given)
    from polykv.models import named_model

    name = PROFILE_NAMES.get(named_model(model).name)
    if name is None:
        raise StudyError(f"no shipped profile for model {model!r}; pass --profile PATH")
    here = Path(__file__).resolve().parents[2] / "profiles" / name
    for path in (here, Path("profiles") / name):
        if path.is_file():
            return str(path.resolve())
    raise StudyError(f"no shipped profile found at {here} or ./profiles/{name}; make one with "
                     f"`polykv calibrate {model} -o profiles/{name}` or pass --profile PATH")


def demo_spec(samples: int, profile: str, budgets: list[str] | None = None, basis: str = "resident", *,
              model: str = "default") -> dict:
    spec = copy.deepcopy(DEMO_SPEC)
    spec["profile"] = profile
    spec["model"] = model
    spec["tasks"][0]["samples"] = int(samples)
    if budgets:
        spec["budgets"] = [str(b) for b in budgets]
    spec["basis"] = basis
    spec["plans"] = kvzip_plans(spec["budgets"], basis, model)
    return spec


def kvzip_plans(budgets: list[str], basis: str, model: str = "default") -> dict[str, str]:
    """``{"kvzip-global@B": absolute path}`` for each budget B with a shipped :data:`KVZIP_PLANS` file of ``model``
    (on the resident basis only: the files are solved on it)."""
    from polykv.models import named_model

    name = KVZIP_PLANS.get(named_model(model).name)
    if basis != "resident" or name is None:
        return {}
    folder = Path(__file__).resolve().parents[2].joinpath(*KVZIP_FOLDER)
    found = {b: folder / name.format(budget=b) for b in budgets}
    return {f"kvzip-global@{b}": str(path) for b, path in found.items() if path.is_file()}


def print_table(results_path: str) -> None:
    """The demo's summary on stdout: per task the policies' accuracy and bytes, MoE-nD's chain, each plan against
    the full cache, the predicted-vs-measured Spearman and the predicted losses; then the report's conclusion."""
    from polykv.profiling.profile import load_profile
    from polykv.studies import designs, predicted
    from polykv.studies.conclusion import conclusion_text, verdict
    from polykv.studies.report import policy_rows
    from polykv.studies.results import Results

    res = Results.load(results_path)
    profile = None
    if res.header["spec"].get("profile") and os.path.isfile(res.header["spec"]["profile"]):
        profile = load_profile(res.header["spec"]["profile"])
    for task in res.tasks:
        print(f"\n{task}: {len(res.items(task))} items per policy; bytes held after compressing the context "
              f"(K/V + metadata), ratio against a 16-bit full cache")
        print(f"{'policy':<16} {'accuracy [Wilson 95%]':<24} {'MiB':>7} {'measured':>9} {'predicted':>9} "
              f"{'nominal':>8}")
        for r in policy_rows(res, task):
            w = r["wilson"]
            acc = f"{w.estimate:6.1%} [{w.low:5.1%}, {w.high:5.1%}]" if w else f"{r['mean']:.3f}"
            nominal = f"{r['full16'] / r['nominal']:.2f}x" if r.get("nominal") else "-"
            pred = f"{r['full16'] / r['predicted']:.2f}x" if r.get("predicted") else "-"
            if r.get("expected_ratio"):  # an allocator plan: the bound above, what it is expected to hold beside it
                pred += f" (expected {r['expected_ratio']:.2f}x)"
            print(f"{r['policy']:<16} {acc:<24} {r['bytes'] / 2 ** 20:7.3f} {r['ratio']:8.2f}x {pred:>9} "
                  f"{nominal:>8}")
        for b in designs.budgets(res):
            chain = designs.moend_chain(res, task, b)
            if chain:
                parts = [f"{k} {v.estimate:+.2f} [{v.low:+.2f}, {v.high:+.2f}]" for k, v in chain["intervals"].items()
                         if k in ("d_quant", "d_evict", "d_total")]
                print(f"MoE-nD chain at {b}: " + "; ".join(parts))
            if "full" in res.policies:
                for name in designs.plans_at(res, b):
                    iv = designs.paired_vs(res, task, name, "full")
                    said = verdict(iv, res.scores(name, task), res.scores("full", task), "the full cache")
                    print(f"  {name} - full: {iv.estimate:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}] ({said})")
            for w in designs.unequal_memory(res, task, designs.plans_at(res, b)):
                print(f"  warning at {b}: {w}")
            pvm = predicted.predicted_vs_measured(res, task, b, profile)
            if pvm is not None:
                sp = pvm["spearman"]
                print(f"  {predicted.SPEARMAN_CONVENTION}; over {pvm['n']} plans at {b}: "
                      + (f"{sp.r:+.3f} (one-sided p = {sp.p_value:.3f})" if sp is not None else
                         f"undefined ({pvm['note']})"))
            if profile is not None:
                for r in predicted.loss_vs_exact(res, b, profile):
                    same = "-" if r["exact_same_rules"] is None else f"{r['exact_same_rules']:.3f}"
                    gap = "" if r["gap"] is None else f" ({r['gap']:+.1%})"
                    rules = ",".join(r["rules"]) if r["rules"] else "all rules"
                    if r.get("skipped"):
                        print(f"  predicted loss {r['policy']}: {r['loss']:.3f}; no gap to the optimum: {r['skipped']}")
                        continue
                    print(f"  predicted loss {r['policy']}: {r['loss']:.3f}; exact optimum over {rules} {same}{gap}; "
                          f"over all rules {r['exact_all_rules']:.3f}")
    print("\nConclusion:")
    for sentence in conclusion_text(res):
        print(f"- {sentence}")


def set_threads(n: int | None) -> None:
    """Use ``n`` CPU threads in torch (None leaves torch's default)."""
    if n is None:
        return
    if n < 1:
        raise StudyError(f"--threads must be at least 1, got {n}")
    import torch

    torch.set_num_threads(n)


def _is_demo_spec(path: str) -> bool:
    raw = read_json_head(path)
    return isinstance(raw, dict) and raw.get("name") == DEMO_SPEC["name"] and "tasks" in raw


def check_demo_folder(out: str, spec_path: str) -> None:
    """The demo's folder holds only what an earlier demo wrote (its spec, results and report)."""
    from polykv.studies.report import check_report_folder
    from polykv.studies.results import is_results_file

    check_output(out, what="demo folder", option="--out", folder=True)
    check_output(spec_path, what="demo spec", option="--out", recognise=_is_demo_spec)
    check_output(os.path.join(out, "results.jsonl"), what="results file", option="--out", recognise=is_results_file)
    check_report_folder(out, "--out")


def run(args) -> int:
    from polykv.models import default_model_path, named_cached_dir, named_model
    from polykv.studies.report import write_report
    from polykv.studies.runner import prepare, run_study
    from polykv.studies.spec import load_spec

    if args.samples < 1:
        raise StudyError(f"--samples must be at least 1, got {args.samples}")
    start = time.perf_counter()
    named = named_model(args.model)
    if named.name == "smollm2-135m":
        default_model_path()  # the model package is there (else: the install command), before any other work
    else:
        named_cached_dir(named.name)  # the model's packages are there (else: the install command)
    set_threads(args.threads)
    spec_path = os.path.join(args.out, "spec.json")
    check_demo_folder(args.out, spec_path)
    os.makedirs(args.out, exist_ok=True)
    spec_dict = demo_spec(args.samples, find_profile(args.profile, args.model), args.budgets, args.basis,
                          model=args.model)
    write_text_atomic(spec_path, json.dumps(spec_dict, indent=2) + "\n")
    spec = load_spec(spec_path)
    results = os.path.join(args.out, "results.jsonl")
    prepared = prepare(spec, results)
    print(f"demo: {len(prepared.policies)} policies x {args.samples} passkey items "
          f"({spec.context_tokens} tokens) -> {results}")
    missing = [b for b in spec_dict["budgets"] if f"kvzip-global@{b}" not in spec_dict["plans"]]
    if missing:
        print(f"demo: no shipped kvzip-global plan at {', '.join(missing)} ({args.basis} basis); those budgets run "
              f"without it")
    counts = run_study(prepared, progress=not args.no_progress)
    print_table(results)
    paths = write_report(results, args.out)
    seconds = time.perf_counter() - start
    print(f"\nran {counts['run']} (skipped {counts['skipped']} already recorded) in {seconds:.0f} s; "
          f"report: {paths[0]}")
    return 0
