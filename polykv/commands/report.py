"""``polykv report RESULTS -o DIR``: Markdown and PNG figures from a study's results file."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="write a study report (Markdown + PNG figures) from a results file",
        description="Accuracy with Wilson intervals, paired bootstrap differences, measured KV bytes, MoE-nD's "
                    "ablation chain, PolyKV's factorial and placement control, budget sweeps; figures of score vs "
                    "measured memory, per-layer route strips and the profile's sensitivity heatmap.")
    p.add_argument("results", nargs="+", help="results file written by `polykv study` (JSONL); several files are "
                   "parts of one experiment (same model, prompts and items), reported together and paired item by "
                   "item")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for report.md and the figures")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile for the sensitivity heatmap (default: the study's own profile)")
    p.set_defaults(func=run)


def run(args) -> int:
    from polykv.studies.report import check_report_folder, write_report

    check_report_folder(args.output, "-o", inputs=[*args.results, args.profile])
    for path in write_report(args.results, args.output, profile_path=args.profile, option="-o"):
        print(f"wrote {path}")
    return 0
