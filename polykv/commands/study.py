"""``polykv study SPEC``: run a study spec (policies x tasks x items), resumably, into a JSONL results file."""

from __future__ import annotations

import os
import sys

from polykv.atomic import check_output
from polykv.commands.demo import set_threads
from polykv.models.devices import check_threads
from polykv.plan.side_files import check_side_files
from polykv.registry import get_registry
from polykv.studies.distributed import run_study_ray
from polykv.studies.report import check_report_folder, write_report
from polykv.studies.results import is_results_file
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study", help="run plans head-to-head on tasks at matched memory (resumable)",
        description="Check the spec (plans, solvers, budgets, tasks, files) before loading the model, solve every "
                    "plan, then run each (policy, task, item) and append its score and measured KV bytes to the "
                    "results file. Run the same command again to resume an interrupted study. See "
                    "docs/studies-guide.md.")
    p.add_argument("spec", help="study spec file (JSON)")
    p.add_argument("--results", metavar="PATH", default=None,
                   help="results file (JSONL); default results/<spec name>/results.jsonl")
    p.add_argument("--report", metavar="DIR", default=None, help="also write the report into DIR when finished")
    p.add_argument("--check", action="store_true", help="check the spec and solve the plans, then stop")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice); 1 is fastest on a machine shared with "
                        "other busy processes")
    ray = p.add_argument_group("running on Ray (docs/integrations.md)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="spread the (policy x item) work over Ray workers: no ADDRESS starts a local Ray (or joins "
                          "the one RAY_ADDRESS names); 'auto' or host:port joins a running cluster")
    ray.add_argument("--workers", type=int, default=None, metavar="N",
                     help="Ray workers (default: one per GPU with --gpus-per-worker, else one per CPU)")
    ray.add_argument("--cpus-per-worker", type=float, default=1, metavar="C", help="CPUs each worker reserves (1)")
    ray.add_argument("--gpus-per-worker", type=float, default=0, metavar="G",
                     help="GPUs each worker reserves; 1 = one worker per GPU, model on cuda (default 0: CPU)")
    ray.add_argument("--policies-per-unit", type=int, default=None, metavar="N",
                     help="send an item's policies to workers in groups of at most N (each group prefills the item "
                          "again); default: all of an item's policies in one unit, one prefill per item")
    p.set_defaults(func=run)


def check_outputs(spec, results: str, report: str | None) -> None:
    """The results file and report folder are none of the spec's inputs and not foreign files."""
    inputs = [spec.source, *spec.digests]
    check_output(results, what="results file", option="--results", inputs=inputs, recognise=is_results_file)
    if report:
        check_report_folder(report, "--report", inputs=inputs + [results])


def run(args) -> int:
    check_threads(args.threads, remote=args.ray is not None)
    spec = load_spec(args.spec)
    results = args.results or os.path.join("results", spec.name, "results.jsonl")
    check_outputs(spec, results, args.report)
    prepared = prepare(spec, results)
    for note in prepared.warnings:
        print(f"polykv study: warning: {note}", file=sys.stderr)
    print(f"{args.spec}: {len(prepared.policies)} policies x {sum(t.samples for t in spec.tasks)} items "
          f"({spec.hash}) -> {results}")
    if args.check:
        for pol in prepared.policies:
            check_side_files(pol.plan, get_registry(), f"{args.spec} (policy {pol.name})")
        for pol in prepared.policies:
            print(f"  {pol.name}: {pol.plan.provenance.note or pol.method}")
        return 0
    set_threads(args.threads)
    if args.ray is None:
        counts = run_study(prepared, progress=not args.no_progress)
    else:
        counts = run_study_ray(prepared, address=None if args.ray == "local" else args.ray, workers=args.workers,
                               cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                               threads=args.threads, progress=not args.no_progress,
                               policies_per_unit=args.policies_per_unit)
    print(f"ran {counts['run']}, skipped {counts['skipped']} already recorded"
          + (f" ({counts['workers']} Ray workers, {counts['retried']} unit(s) rerun after a worker died)"
             if args.ray is not None else ""))
    if args.report:
        for path in write_report(results, args.report, option="--report"):
            print(f"wrote {path}")
    return 0
