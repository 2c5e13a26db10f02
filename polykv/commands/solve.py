"""``polykv solve``: turn a profile file and a memory budget into a plan file."""

from __future__ import annotations

import functools
import json
import math
import sys

import attrs

from polykv.atomic import check_output
from polykv.commands.plan import model_geometry
from polykv.contract.model_data import load_side_files, needs_of_rules, side_file_references
from polykv.errors import ProfileError, SolverError
from polykv.models.devices import check_device
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.models.local_folder import load_by_name
from polykv.plan.io import is_plan_file
from polykv.profiling.budget import Budget
from polykv.profiling.calibrate_settings import query_stats_path
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.solvers import solve
from polykv.solvers.refine import MeasureOn, OnRay
from polykv.solvers.windowed import budget_bytes


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "solve", help="make a plan from a profile at a memory budget",
        description="Run a registered solver on a profile (see docs/solvers.md) and write the plan. "
                    "Budgets count resident bytes by default: what the runtime holds (codes, scales, residuals, "
                    "positions and rule state) for --batch rows stored in --cache-dtype. "
                    "Example: polykv solve profiles/x.json --budget 8x --context 4096 --solver exact -o plan.json")
    p.add_argument("profile", help="profile file (JSON, see docs/profiles.md)")
    p.add_argument("--budget", required=True, metavar="B",
                   help="bytes (1048576 or 3MiB), a ratio against a full 16-bit cache (8x), "
                        "or average tokens per layer at 16 bits (256tok)")
    p.add_argument("--context", required=True, type=int, metavar="N",
                   help="context length in tokens the budget and predictions refer to")
    p.add_argument("--basis", choices=("resident", "nominal"), default="resident",
                   help="what the budget counts: resident bytes the runtime holds, metadata included (default), or "
                        "MoE-nD's nominal bytes (codes only, keep x T x Hkv x d x (K + V) / 8)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="batch rows a resident budget counts (default 1)")
    p.add_argument("--cache-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="storage dtype of unquantized K/V, scales and residuals a resident budget counts "
                        "(default bfloat16)")
    p.add_argument("--capacities", choices=("ratio", "tokens"), default="ratio",
                   help="write capacities as ratios of the context (default: the plan keeps its compression at "
                        "any length) or as token counts for --context")
    p.add_argument("--solver", default="exact", metavar="NAME",
                   help="registered solver (default: exact); `polykv plugins` lists them")
    p.add_argument("--param", action="append", default=[], metavar="K=V",
                   help="solver parameter; V is read as JSON when it parses (3, 0.5, null, [..]), else a string")
    p.add_argument("--metric", default=None, metavar="NAME",
                   help="metric table to route on, e.g. l2 or kl (default: the profile's routing metric, kl when "
                        "calibration measured it; l2 for profiles that record none); same as --param metric=NAME")
    p.add_argument("--quantizer", default=None, metavar="NAME",
                   help="the quantizer the plan must store its widths with; refused unless it is the one the "
                        "profile was calibrated with (default: the profile's, which every plan uses)")
    p.add_argument("--quantizer-param", action="append", default=None, metavar="K=V",
                   help="with --quantizer: its parameters, which must equal the profile's")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="check first that the profile was measured on this model: 'default' (SmolLM2-135M), a "
                        "model name (gemma3-270m) or a local model folder holding config.json; a measuring solver (refine) loads it and runs "
                        "its candidate plans on it")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="measuring solvers (refine): context tokens each held-out sequence compresses "
                        "(default: the profile's calibration context)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="measuring solvers: device the model runs on (default cpu)")
    p.add_argument("-o", "--output", required=True, metavar="PLAN", help="plan file to write (atomically)")
    ray = p.add_argument_group("measuring on Ray (docs/solvers.md#refine)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="measuring solvers: measure each step's candidate plans on Ray workers: no ADDRESS starts a "
                          "local Ray, 'auto' or host:port joins a cluster")
    ray.add_argument("--workers", type=int, default=None, metavar="N",
                     help="Ray workers (default: the cluster's CPUs / --cpus-per-worker)")
    ray.add_argument("--cpus-per-worker", type=float, default=1, metavar="C", help="CPUs each worker reserves (1)")
    p.set_defaults(func=run)


def _no_constant(name: str):
    raise ValueError(name)


def parse_params(items: list[str], option: str = "--param") -> dict:
    """``KEY=VALUE`` items as a dict; VALUE is read as JSON when it parses (NaN and infinity are refused); a key
    given twice is refused (one value would silently win)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SolverError(f"{option} {item!r}: expected KEY=VALUE, e.g. {option} rule=tova")
        if key in out:
            first = next(i for i in items if i.partition("=")[0] == key)
            raise SolverError(f"{option} {key}=: given twice ({option} {first} and {option} {item}); give each "
                              f"key once")
        try:
            out[key] = json.loads(value, parse_constant=_no_constant)
        except json.JSONDecodeError:
            out[key] = value
        except ValueError:
            raise SolverError(f"{option} {item!r}: {value} is not a finite number; give a finite value") from None
        if isinstance(out[key], float) and not math.isfinite(out[key]):
            raise SolverError(f"{option} {item!r}: {value} is not a finite number; give a finite value")
    return out


def with_profile_data(plan, profile_path: str):
    """``plan`` recording the profile's side files that hold the per-model data its rules read (its
    ``model_data`` field), so that ``polykv.apply`` finds them."""
    needs = needs_of_rules(get_registry(), sorted(plan.rules_used()))
    if plan.low_rank:  # low-rank layers project with the key/value bases calibrated beside the profile
        needs.append(KV_BASES_NEED)
    refs = side_file_references(profile_path, needs)
    return attrs.evolve(plan, model_data={**refs, **plan.model_data}) if refs else plan


def measuring_model(args, profile, params: dict, geometry=None):
    """The model a measuring solver runs its plans on (loaded from ``--model``), or None for the others; puts
    ``--tokens`` into ``params``. Its parameters, and the held-out sequences against the positions of the model's
    ``geometry``, are checked before the model loads."""
    registry = get_registry()
    measures = getattr(registry.solver(args.solver), "needs_model", False)
    if args.tokens is not None:
        if not measures:
            raise SolverError(f"--tokens {args.tokens}: solver '{args.solver}' does not measure plans on a model; "
                              "leave --tokens out (it sets the held-out context of measuring solvers such as refine)")
        if "tokens" in params and params["tokens"] != args.tokens:
            raise SolverError(f"--tokens {args.tokens} and --param tokens={params['tokens']} disagree; give one")
        params["tokens"] = args.tokens
    if not measures:
        if args.ray is not None:
            raise SolverError(f"--ray: solver '{args.solver}' measures no plans on a model, so there is nothing to send "
                              "to Ray workers; leave --ray out (it serves measuring solvers such as refine)")
        return None
    if not args.model:
        raise SolverError(f"--solver {args.solver} measures its candidate plans on the model: add --model default "
                          "(SmolLM2-135M, offline) or --model FOLDER (a local model with its tokenizer)")
    check_device(args.device, error=SolverError)
    solver = registry.solver(args.solver)(registry=registry)
    checked = solver.params(params)  # bad parameters are refused before the load
    if hasattr(solver, "held_out"):
        solver.held_out(profile, checked, getattr(geometry, "max_positions", None))
    model, tokenizer = load_by_name(args.model, dtype="float32", device=args.device, error=ProfileError)
    rules = sorted({c.rule for c in profile.configs if not c.keeps_everything})
    data = load_side_files(args.profile, needs_of_rules(registry, rules), model=model)
    on_ray = None
    if args.ray is not None:
        import torch

        on_ray = OnRay(loader=functools.partial(load_by_name, args.model, dtype="float32", device=args.device,
                                                error=ProfileError),
                       address=args.ray, workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                       threads=torch.get_num_threads())
    return MeasureOn(model=model, tokenizer=tokenizer, model_data=data, name=args.model, ray=on_ray,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))


def check_ray(args) -> None:
    """``--workers`` / ``--cpus-per-worker``: only with ``--ray``, at least one worker and a positive CPU count."""
    if args.ray is None and (args.workers is not None or args.cpus_per_worker != 1):
        raise SolverError("--workers / --cpus-per-worker place Ray workers; add --ray (or leave them out)")
    if args.ray is not None and (args.workers is not None and args.workers < 1 or not args.cpus_per_worker > 0):
        raise SolverError(f"--workers {args.workers} / --cpus-per-worker {args.cpus_per_worker}: give a positive "
                          "number of workers and of CPUs per worker")


def check_metric(metric: str, params: dict, profile, solver: str) -> str:
    """``--metric``: a table the profile has, for a solver that routes on one, not contradicting ``--param``."""
    if "metric" in params and params["metric"] != metric:
        raise SolverError(f"--metric {metric} and --param metric={params['metric']} disagree; give one of them")
    if metric not in profile.metrics:
        raise SolverError(f"--metric {metric}: {profile.source} has no such metric table; it has "
                          f"{', '.join(sorted(profile.metrics))}")
    cls = get_registry().solver(solver)
    if "metric" not in getattr(cls, "defaults", {}):
        raise SolverError(f"--metric: solver '{solver}' does not route on a metric table; leave --metric out or "
                          f"use a solver that does (exact, moend-greedy, uniform, quant-only)")
    return metric


def run(args) -> int:
    check_output(args.output, what="plan file", option="-o", recognise=is_plan_file,
                 inputs=[args.profile, query_stats_path(args.profile)])
    check_ray(args)
    profile = load_profile(args.profile)
    if args.batch < 1:
        raise SolverError(f"--batch must be a positive number of rows, got {args.batch}")
    budget = Budget.parse(args.budget, args.context, basis=args.basis, batch=args.batch, cache_dtype=args.cache_dtype)
    geometry = None
    if args.model:
        geometry = model_geometry(args.model)
    qparams = None if args.quantizer_param is None else parse_params(args.quantizer_param, "--quantizer-param")
    params = parse_params(args.param)
    if args.metric is not None:
        params = {**params, "metric": check_metric(args.metric, params, profile, args.solver)}
    measure_on = measuring_model(args, profile, params, geometry)
    plan = solve(profile, budget, args.solver, geometry=geometry, capacities=args.capacities,
                 quantizer=args.quantizer, quantizer_params=qparams, model=measure_on, **params)
    plan = with_profile_data(plan, args.profile)
    plan.save(args.output)
    prov = plan.provenance
    loss = "n/a" if prov.predicted_loss is None else f"{prov.predicted_loss:.6g}"
    limit = budget_bytes(profile, budget)  # window-bounded layers at their window, the budget on the others
    measured = prov.measured or {}
    if measured:
        print(f"{args.output}: measured {measured['measured']} plan(s) on {measured['sequences']} held-out sequences "
              f"of {measured['context_tokens']} + {measured['follow_up']} tokens in {measured['seconds']:.1f} s: "
              f"{measured['metric']} {measured.get('exact_kl', measured.get('start_kl')):.6g} "
              f"({measured.get('start', 'exact')}) -> {measured['refine_kl']:.6g} nats")
    print(f"{args.output}: {args.solver}, {plan.num_layers} layers, budget {budget.describe()} = {limit} bytes; "
          f"predicted {prov.predicted_bytes} {budget.basis} bytes ({prov.predicted_bytes / max(limit, 1):.1%}), "
          f"loss {loss}"
          + (f"; {prov.note}" if prov.note else ""))
    return 0
