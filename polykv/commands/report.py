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
    p.add_argument("--csv", action="store_true",
                   help="also write policies.csv (one row per task and policy: items, mean score, Wilson interval, "
                        "measured bytes, ratio to a 16-bit full cache, paired difference to full) and items.csv (one "
                        "row per result, with the generated text) into DIR")
    p.set_defaults(func=run)


def run(args) -> int:
    from polykv.studies.export import check_csv_outputs, csv_texts, write_csv
    from polykv.studies.report import check_report_folder, write_report

    inputs = [*args.results, args.profile]
    check_report_folder(args.output, "-o", inputs=inputs)
    texts = None
    if args.csv:  # every output is checked and every table computed before anything is written
        check_csv_outputs(args.output, "-o", inputs)
        texts = csv_texts(args.results)
    written = write_report(args.results, args.output, profile_path=args.profile, option="-o")
    if texts is not None:
        written += write_csv(args.results, args.output, option="-o", texts=texts)
    for path in written:
        print(f"wrote {path}")
    return 0
