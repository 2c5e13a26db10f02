"""``polykv plan show`` and ``polykv plan validate``: read a plan file, check it, print what it does."""

from __future__ import annotations

import os

from polykv.contract.model_data import needs_of_rules
from polykv.contract.probe import probe_tokens
from polykv.errors import PlanError, PolykvError
from polykv.memory import memory_report
from polykv.models import (MODEL_ALIASES, NAMED_MODELS, cached_complete, default_geometry,
                           model_geometry as named_geometry, read_local_config)
from polykv.models.geometry import fingerprints_match, geometry_from_config
from polykv.plan import MAX_CONTEXT_TOKENS, load_plan
from polykv.plan.groups import check_group_bounds
from polykv.plan.side_files import check_side_files
from polykv.registry import get_registry
from polykv.runtime.checks import layer_spans
from polykv.storage.layer_share import SHARE_PARAMS, retained_count

DEFAULT_SHOW_CONTEXT = 2048


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="show or validate a plan file",
                              description="Inspect plan files (see docs/plan-format.md).")
    sub = p.add_subparsers(dest="plan_command", metavar="ACTION", required=True)

    show = sub.add_parser("show", help="print a plan's per-layer ops, bits and predicted memory")
    show.add_argument("plan", help="plan file (JSON)")
    show.add_argument("--context", type=int, default=None, metavar="N",
                      help="context length for capacities and memory (default: the plan's "
                           f"provenance.context_tokens, else {DEFAULT_SHOW_CONTEXT})")
    show.add_argument("--model", default=None, metavar="MODEL",
                      help="'default', a model name (gemma3-270m) or a local model folder; default: the shape "
                           "recorded in the plan")
    show.set_defaults(func=run_show)

    val = sub.add_parser("validate", help="check a plan against the installed plugins (and a model)")
    val.add_argument("plan", help="plan file (JSON)")
    val.add_argument("--model", default=None, metavar="MODEL",
                     help="also check layer count, KV heads and head_dim against 'default' (SmolLM2-135M) "
                          "or a local model folder holding config.json")
    val.set_defaults(func=run_validate)


def model_geometry(spec: str):
    """Geometry for ``--model``: ``"default"``, a model name (``gemma3-270m``) or a local folder with a
    transformers ``config.json``."""
    if spec == "default":
        return default_geometry()
    if spec in NAMED_MODELS or spec in MODEL_ALIASES:
        return named_geometry(spec)
    if not os.path.isdir(spec) or not os.path.lexists(os.path.join(spec, "config.json")):
        raise PolykvError(f"--model {spec!r}: expected 'default', one of {sorted(NAMED_MODELS)} or a local model "
                          f"folder holding config.json (models are never downloaded)")
    try:
        read_local_config(spec)
    except PolykvError as exc:
        raise PolykvError(f"--model {spec!r}: {exc}") from None
    import transformers

    return geometry_from_config(transformers.AutoConfig.from_pretrained(spec, local_files_only=True))


def recognised_geometry(plan):
    """The geometry of a named model whose converted copy is cached and whose config the plan's fingerprint
    names (so that ``show`` counts its window-bounded layers without ``--model``); None otherwise."""
    fingerprint = plan.model.fingerprint if plan.model is not None else None
    if not fingerprint:
        return None
    for name in NAMED_MODELS:
        if not cached_complete(name):
            continue
        geo = named_geometry(name)
        if geo.fingerprint.split("+", 1)[0] == fingerprint.split("+", 1)[0]:
            return geo
    return None


def _load(path: str, geometry=None, context: int | None = None):
    """The checked plan; its allocation groups are also budgeted at ``context`` (default: the plan's own)."""
    plan = load_plan(path, registry=get_registry(), geometry=geometry)
    context = context or plan.provenance.context_tokens or DEFAULT_SHOW_CONTEXT
    check_group_bounds(plan, get_registry(), context, source=path)
    return plan


def check_for_model(plan, geometry, source: str, context: int) -> None:
    """What only the model can refute, before it runs: the per-model data files the plan names (field
    ``model_data``) were measured on this model, and the plan's probe fits the model's positions after a
    ``context``-token prompt."""
    import torch

    registry = get_registry()
    needs = {n.key: n for n in needs_of_rules(registry, sorted(plan.rules_used()))}
    for key, path in sorted(plan.model_data.items()):
        if key not in needs or not os.path.isfile(path):
            continue  # plan validate refuses it (check_side_files); plan show leaves it to the runtime
        try:
            data = needs[key].load(path)
        except PolykvError as exc:
            raise PolykvError(f"{source}: field model_data.{key}: {exc}") from None
        theirs = getattr(data, "fingerprint", None)
        if not fingerprints_match(theirs, geometry.fingerprint):
            raise PolykvError(f"{source}: field model_data.{key}: {path} holds {needs[key].description or key} "
                              f"measured on model {theirs}, not on {geometry.fingerprint}; recompute it on this model "
                              f"(or remove the field to compute it from the offline corpus)")
    limit = geometry.max_positions
    if limit is None:
        return
    for lp in plan.layers:
        op = lp.prefill
        if op.keeps_everything or not registry.has("rule", op.rule) or \
                not registry.rule(op.rule).declares_probe():
            continue
        try:
            chunks = registry.rule(op.rule)(**op.params).probe_chunks(torch.zeros(1, context, dtype=torch.long))
        except ValueError:
            continue  # reported by plan show's probe line and refused by the runtime
        longest = max((c.num_tokens for c in chunks or []), default=0)
        if context + longest > int(limit):
            raise PolykvError(f"{source}: layers[{lp.layer}].prefill: rule '{op.rule}' runs a probe of up to "
                              f"{longest} tokens after the {context}-token prompt, {context + longest} positions, more "
                              f"than the model's {int(limit)} (max_position_embeddings); shorten the context or lower "
                              f"the rule's chunk_size")


def run_validate(args) -> int:
    geometry = model_geometry(args.model) if args.model else None
    plan = _load(args.plan, geometry)
    check_side_files(plan, get_registry(), args.plan)
    target = ""
    if geometry is not None:
        _memory(plan, geometry, args.plan, plan.provenance.context_tokens or DEFAULT_SHOW_CONTEXT)
        check_for_model(plan, geometry, args.plan, plan.provenance.context_tokens or DEFAULT_SHOW_CONTEXT)
        target = f" for model {geometry.fingerprint}"
    print(f"{args.plan}: valid plan, {plan.num_layers} layers{target}")
    return 0


def run_show(args) -> int:
    if args.context is not None and not 1 <= args.context <= MAX_CONTEXT_TOKENS:
        raise PolykvError(f"--context must be a number of tokens in [1, {MAX_CONTEXT_TOKENS}], got {args.context}")
    geometry = model_geometry(args.model) if args.model else None
    plan = _load(args.plan, geometry, args.context)
    if geometry is None:
        geometry = recognised_geometry(plan)
    if geometry is None and plan.model is None:
        raise PolykvError(f"{args.plan}: the plan records no model shape (field 'model' is null); pass "
                          f"--model default or --model FOLDER to predict its memory")
    context = args.context or plan.provenance.context_tokens
    context_note = ""
    if context is None:
        context, context_note = DEFAULT_SHOW_CONTEXT, " (the default: the plan records none; set --context N)"
    report = _memory(plan, geometry, args.plan, context)
    if args.model:
        check_for_model(plan, geometry, args.plan, context)
    print(format_plan(plan, args.plan, context, context_note, geometry=geometry, report=report))
    return 0


def _memory(plan, geometry, source: str, context: int):
    """The plan's memory report; also proves every layer's quantizer can store this model's heads."""
    try:
        return memory_report(plan, geometry, context)
    except PlanError as exc:
        if exc.source:
            raise
        raise PlanError(exc.message, source=source, layer=exc.layer,
                        field=_layer_field(exc.layer, exc.field), hint=exc.hint) from None


def _layer_field(layer, field):
    if layer is None or not field or field.startswith("layers["):
        return field
    return f"layers[{layer}].{field}"


def budget_basis(prov) -> str:
    """One line: what the plan's budget counted (older plans without a basis were budgeted nominally)."""
    if prov.basis == "resident":
        return (f"resident bytes (stores + metadata), batch {prov.batch or 1}, {prov.cache_dtype or 'bfloat16'} "
                f"storage, at {prov.context_tokens} tokens")
    if prov.basis == "nominal":
        return f"nominal bytes (MoE-nD: codes only), at {prov.context_tokens} tokens"
    return f"not recorded (nominal bytes: the plan predates recorded bases), at {prov.context_tokens} tokens"


def absolute_capacities(plan) -> int:
    """Number of rule ops whose capacity is a token count rather than a ratio."""
    return sum(1 for lp in plan.layers for op in (lp.prefill, lp.decode)
               if not op.keeps_everything and op.capacity is not None)


def probe_cost(plan, context: int, registry=None) -> str:
    """One line on the plan's probe (a model pass after the prompt, :mod:`polykv.contract.probe`): which rule on
    which layers, and the extra forward tokens it costs per sequence at ``context`` prompt tokens; "" without one."""
    import torch

    if registry is None:
        registry = get_registry()
    found = {}
    for lp in plan.layers:
        op = lp.prefill
        if op.keeps_everything or not registry.has("rule", op.rule):
            continue
        cls = registry.rule(op.rule)
        if cls.declares_probe():
            found.setdefault((op.rule, repr(sorted(op.params.items()))), (cls, op.params, []))[2].append(lp.layer)
    parts = []
    for (name, _), (cls, params, layers) in found.items():
        try:
            cost = probe_tokens(cls(**params).probe_chunks(torch.zeros(1, int(context), dtype=torch.long)) or [])
            what = f"{cost} extra forward tokens ({cost / max(int(context), 1):.2f}x the prompt)"
        except ValueError as exc:
            what = f"cannot run as given: {exc}"
        parts.append(f"rule '{name}' (layers {layer_spans(layers)}) runs a model pass after the {context}-token prompt: "
                     f"{what}")
    return "; ".join(parts)


def share_summary(plan, context: int) -> str:
    """One line on the plan's shared layer pairs: the pairs, their merge parameters, the tokens kept unmerged."""
    parts = []
    for lo, hi in plan.share_pairs():
        params = dict(SHARE_PARAMS, **plan.layers[hi].share_params)
        parts.append(f"{lo}-{hi} (t={params['interpolation']:g}, {retained_count(context, params['retention_ratio'])} "
                     f"of {context} tokens per head unmerged)")
    return (f"{len(parts)} layer pair(s) merged after prefill (MiniCache): " + ", ".join(parts)
            + "; decode tokens are stored per layer, unmerged")


MEMORY_COLUMNS = ("KEPT", "NOMINAL_B", "RESIDENT_B", "METADATA_B")


def _memory_cells(row) -> tuple[str, ...]:
    """A layer's memory cells: kept tokens (``<=`` for an allocator's bound), nominal, resident, metadata bytes."""
    return (("<=" if row.bound else "") + f"{row.kept_tokens:,}", f"{row.nominal_bytes:,}", f"{row.resident_bytes:,}",
            f"{row.metadata_bytes:,}" + ("" if None not in row.metadata.values() else "+?"))


def budget_phrase(prov) -> str:
    """The plan's budget in words: ``8x of the 16-bit cache (resident basis)``; ``-`` when it records none."""
    if not prov.budget:
        return "-"
    basis = f" ({prov.basis} basis)" if prov.basis else ""
    parts = []
    for kind, value in prov.budget.items():
        if kind == "ratio":
            parts.append(f"{value:g}x of the 16-bit cache{basis}")
        elif kind == "bytes":
            parts.append(f"{int(value):,} bytes{basis}")
        elif kind == "tokens_per_layer":
            parts.append(f"{int(value):,} tokens per layer")
        else:
            parts.append(f"{kind} {value}")
    return "; ".join(parts)


def format_plan(plan, source: str, context: int, context_note: str = "", geometry=None, report=None) -> str:
    """Header, provenance and one row per layer: ops with capacities resolved at ``context``.

    With a model ``geometry`` that has sliding-window or chunked layers, an ``ATTENTION`` column marks
    them with their bound (``sliding<=511``): they keep at most that many tokens whatever the plan says.
    With the plan's memory ``report`` (:func:`polykv.memory.memory_report` at ``context``), each layer's row also
    gives its kept tokens and bytes, followed by the totals and ratios: every layer is listed once.
    """
    prov = plan.provenance
    lines = [f"plan {source}  (schema {plan.written_schema_version}, {plan.num_layers} layers)"]
    if plan.model is not None:
        m = plan.model
        lines.append(f"model    {m.name or '?'}  kv_heads={m.num_kv_heads} head_dim={m.head_dim} "
                     f"fingerprint={m.fingerprint or '-'}")
    lines.append(f"solver   {prov.solver or 'hand-made'}")
    lines.append(f"budget   {budget_phrase(prov)}")
    if prov.budget:
        lines.append("basis    " + budget_basis(prov))
    if prov.predicted_loss is not None or prov.predicted_bytes is not None:
        lines.append(f"predicts loss={prov.predicted_loss}  bytes={prov.predicted_bytes} "
                     f"({prov.basis or 'nominal'}) at {prov.context_tokens} tokens")
    tokens = absolute_capacities(plan)
    if tokens:
        budgeted = (f"budgeted for {prov.context_tokens}-token contexts" if prov.context_tokens
                    else "budgeted for a context length the plan does not record")
        lines.append(f"capacity {tokens} op(s) keep absolute token counts, {budgeted}: at other lengths they hold "
                     f"another share of the cache")
    if prov.note:
        lines.append(f"note     {prov.note}")
    lines.append(f"decode eviction fires past capacity + {plan.trigger.decode_slack} tokens")
    lines.append(f"context  {context} tokens{context_note}")
    probe = probe_cost(plan, context)
    if probe:
        lines.append("probe    " + probe)
    pairs = plan.share_pairs()
    if pairs:
        lines.append("share    " + share_summary(plan, context))
    pair_of = {layer: f"{lo}-{hi}" for lo, hi in pairs for layer in (lo, hi)}
    windowed = geometry is not None and hasattr(geometry, "windowed_layers") and geometry.windowed_layers()
    ranks = plan.low_rank
    memory = {r.layer: r for r in report.rows} if report is not None else None
    rows = [("LAYER", "PREFILL", "DECODE", "K", "V", "QUANTIZER") + (("K_RANK", "V_RANK") if ranks else ())
            + (("ATTENTION",) if windowed else ()) + (("SHARE",) if pairs else ())
            + (MEMORY_COLUMNS if memory is not None else ())]
    for lp in plan.layers:
        ops = []
        for op in (lp.prefill, lp.decode):
            cap = op.resolve_capacity(context)
            ops.append(op.describe() if cap is None or op.capacity is not None else f"{op.describe()}={cap}")
        attention = ()
        if windowed:
            kind = geometry.layer_types[lp.layer].replace("_attention", "")
            bound = geometry.token_bound(lp.layer)
            attention = (kind if bound is None else f"{kind}<={bound}",)
        rank = tuple("full" if r is None else str(r) for r in (lp.k_rank, lp.v_rank)) if ranks else ()
        mark = "w" if memory is not None and memory[lp.layer].window_bound is not None else ""
        rows.append((str(lp.layer) + mark, ops[0], ops[1], str(lp.k_bits), str(lp.v_bits),
                     lp.quantizer if lp.quantized else "-") + rank + attention
                    + ((pair_of.get(lp.layer, "-"),) if pairs else ())
                    + (_memory_cells(memory[lp.layer]) if memory is not None else ()))
    if memory is not None:
        rows.append(("total",) + ("",) * (len(rows[0]) - 1 - len(MEMORY_COLUMNS)) + (
            "", f"{report.nominal_total:,}", f"{report.resident_total:,}",
            f"{report.metadata_total:,}" + ("" if report.metadata_complete else "+?")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = len(rows[0]) - len(MEMORY_COLUMNS) if memory is not None else len(rows[0])
    lines.extend("  ".join(c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 .rstrip() for r in rows)
    if memory is not None:
        lines.extend(report.footer_lines())
    if ranks:
        lines.append("K_RANK/V_RANK: channels of the stored key/value codes on the layer's offline bases (full = the "
                     "head dim, no basis)")
    if windowed:
        lines.append(f"{len(windowed)} window-bounded layers keep at most their model's window whatever the plan "
                     f"says; a plan may compress or quantize inside it")
    return "\n".join(lines)
