"""``polykv report RESULTS -o DIR``: Markdown and figures (PNG, SVG or PDF) from a study's results file.

The report's own modules load matplotlib and the study machinery, and every verb's module is imported when the
command line starts: they are imported when this verb runs (its options come from the light
:mod:`polykv.studies.options`)."""

from __future__ import annotations

import os

from polykv.errors import ProfileError
from polykv.studies.options import DEFAULT_DPI, FORMATS, PLACEMENT_METRICS, check_dpi, parse_formats


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="write a study report (Markdown + figures) from a results file",
        description="A conclusion per task and budget and a glossary of the design names, then accuracy with Wilson "
                    "intervals, paired bootstrap differences, measured KV bytes, MoE-nD's "
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
    p.add_argument("--format", default="png", metavar="FMT",
                   help=f"figure formats, comma separated, from {', '.join(FORMATS)} (default png); e.g. --format "
                        "svg,pdf writes every figure as SVG and PDF for a paper (report.md embeds the PNG when asked "
                        "for, else the first format)")
    p.add_argument("--dpi", type=int, default=DEFAULT_DPI, metavar="N",
                   help=f"resolution of the figures in dots per inch (default {DEFAULT_DPI})")
    p.add_argument("--placement-metric", default="top-1", choices=PLACEMENT_METRICS,
                   help="what ranks the guided route among its random placements: top-1 (the task's score; "
                        "default) or kl (mean KL against the full cache, on tasks that measured it)")
    p.set_defaults(func=run)


def _model(m) -> str:
    get = m.get if isinstance(m, dict) else lambda k: getattr(m, k, None)
    return (f"{get('fingerprint') or 'of unknown fingerprint'} ({get('num_layers')} layers, {get('num_kv_heads')} KV "
            f"heads, head dim {get('head_dim')})")


def check_profile_model(results: list[str], profile_path: str) -> None:
    """``--profile``: a profile measured on the model the study ran (its policies' plans say which), else refused
    naming both models."""
    from polykv.models.geometry import fingerprints_match
    from polykv.profiling.profile import load_profile
    from polykv.studies.combine import combine_results

    res = combine_results(results)
    prof = load_profile(profile_path).model
    for rec in res.policies.values():
        model = (rec.get("plan") or {}).get("model") if isinstance(rec.get("plan"), dict) else None
        if not isinstance(model, dict):
            continue
        if any(model.get(k) != getattr(prof, k) for k in ("num_layers", "num_kv_heads", "head_dim")) or \
                not fingerprints_match(model.get("fingerprint"), prof.fingerprint):
            raise ProfileError(f"--profile {profile_path}: the profile was measured on model {_model(prof)}, but the "
                               f"study in {res.path} ran model {_model(model)} (policy '{rec.get('policy')}'); give "
                               f"a profile of the study's model, or leave --profile out")
        return


def run(args) -> int:
    from polykv.studies.export import check_csv_outputs, csv_texts, write_csv
    from polykv.studies.report import check_report_folder, write_report

    formats, dpi = parse_formats(args.format), check_dpi(args.dpi)
    inputs = [*args.results, args.profile]
    check_report_folder(args.output, "-o", inputs=inputs)
    if args.profile is not None and os.path.isfile(args.profile):
        check_profile_model(args.results, args.profile)
    texts = None
    if args.csv:  # every output is checked and every table computed before anything is written
        check_csv_outputs(args.output, "-o", inputs)
        texts = csv_texts(args.results)
    written = write_report(args.results, args.output, profile_path=args.profile, option="-o", formats=formats,
                           dpi=dpi, placement_metric=args.placement_metric)
    if texts is not None:
        written += write_csv(args.results, args.output, option="-o", texts=texts)
    for path in written:
        print(f"wrote {path}")
    return 0
