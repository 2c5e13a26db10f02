"""Calibration: measure a model's per-layer sensitivity profile (MoE-nD tables, PolyKV statistics).

>>> result = calibrate(model, sequences, CalibrationSettings(prefix=512))     # doctest: +SKIP
>>> result.profile.save("x.profile.json"); result.query_stats.save("x.qstats.safetensors")  # doctest: +SKIP

Steps (``docs/calibration.md``):

1. The per-model data the calibrated rules declare (:mod:`polykv.contract.model_data`; e.g. query statistics,
   :func:`~polykv.adapters.rules.query_stats.compute_query_stats`), computed over the calibration
   sequences, passed to rules as ``model_data[need.key]`` and saved beside the profile.
2. One captured forward per sequence (:mod:`polykv.profiling.capture`).
3. Per layer: the ``l2`` error of every candidate config (:mod:`polykv.profiling.sensitivity`),
   PolyKV's ``cosine`` per rule and ``entropy`` (:mod:`polykv.profiling.routing_stats`), each averaged
   over sequences; optionally ``delta_ppl`` per rule and the ``kl`` validation through the runtime
   (:mod:`polykv.profiling.validation`). Each finished layer is checkpointed
   (:mod:`polykv.profiling.checkpoint`).

What is measured and on what (:class:`CalibrationSettings`, the candidate configs, the corpus sequences) and
what comes back (:class:`CalibrationResult`) are in :mod:`polykv.profiling.calibrate_settings`.
"""

from __future__ import annotations

import platform
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from polykv.attention.signals import signal_request
from polykv.errors import ProfileError
from polykv.models.geometry import geometry_of_model, rope_of_model
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.profiling.rank_error import layer_rank_errors
from polykv.profiling.capture import capture_sequence, stack_layer
from polykv.profiling.checkpoint import Checkpoint, run_digest
from polykv.profiling import axes_endtoend as axes
from polykv.profiling.calibrate_axes import measure_pairs, pair_stats, pair_uppers, rank_pairs, with_ranks
from polykv.profiling.calibrate_settings import (CalibrationResult, CalibrationSettings, candidate_configs,
                                                 check_head_losses, default_rules)
from polykv.contract.model_data import compute_data, needs_of_rules, tokenizer_of
from polykv.profiling.objectives import METRIC_OF, build as followups, describe as describe_objective, parse_objectives
from polykv.profiling.profile import Profile, ProfileProvenance, StatTable, model_info, now_iso
from polykv.profiling.profile_checks import MIX_METRIC, mix_tables
from polykv.profiling.routing_stats import attention_entropy, rule_cosines
from polykv.profiling.sensitivity import LayerContext, full_reference, layer_l2
from polykv.profiling import endtoend as e2e
from polykv.profiling import validation as val
from polykv.runtime.session import run_probe


def _probes(registry, name: str) -> bool:
    return registry.has("rule", name) and registry.rule(name).declares_probe()


def _versions() -> dict[str, str]:
    import transformers

    from polykv import __version__

    return {"polykv": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


class _Units:
    """One progress bar (with its ETA) over every (layer, config) measurement still to do; silent when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="calibrating (layer, config)", unit="unit", smoothing=0.05)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def layer(self, layer: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"layer {layer}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def calibrate(model, sequences: Sequence[torch.Tensor], settings: CalibrationSettings = CalibrationSettings(), *,
              heldout: Sequence[torch.Tensor] = (), checkpoint_dir: str | None = None, corpus: str = "",
              registry=None, progress: bool = False, tokenizer=None,
              on_layer: Callable[[int], None] | None = None, layers: Sequence[int] | None = None,
              precomputed: Mapping[int, Mapping[str, Any]] | None = None) -> CalibrationResult:
    """Measure a profile of ``model`` on ``sequences`` (see the module docstring).

    Parameters
    ----------
    model : transformers causal LM (loaded with ``attn_implementation="sdpa"``)
    sequences : list of LongTensor [T]
        Calibration token ids, every one longer than ``settings.prefix``.
    heldout : list of LongTensor [T]
        Held-out sequences of the end-to-end ``kl`` metric (:mod:`polykv.profiling.endtoend`; empty = none).
        With them the profile routes on ``kl`` by default; with several ``settings.objectives``
        (:mod:`polykv.profiling.objectives`) each is a table and the profile routes on their mix, ``kl_mix``.
    checkpoint_dir : str, optional
        Folder of per-layer checkpoints (resume); None keeps everything in memory.
    corpus : str
        Description of where the sequences came from, for the profile's provenance.
    tokenizer : optional
        The model's tokenizer, for per-model data computed from prompts (kvzip's head scores) and the
        reconstruction and retrieval objectives; None: the tokenizer saved beside the model, if any.
    on_layer : callable, optional
        Called with the layer index after each layer is computed and checkpointed (not for resumed layers).
    layers : sequence of int, optional
        Compute only these layers (one worker's share of a distributed run, :mod:`polykv.profiling.distributed`):
        the result holds their rows in ``arrays`` and no profile.
    precomputed : mapping, optional
        ``{layer: rows}`` computed elsewhere (by workers), taken as finished layers.
    """
    if registry is None:
        from polykv.registry import get_registry

        registry = get_registry()
    start = time.perf_counter()
    seqs = [torch.as_tensor(s).view(-1) for s in sequences]
    held = [torch.as_tensor(s).view(-1) for s in heldout]
    P = int(settings.prefix)
    short = [i for i, s in enumerate(seqs + held) if s.numel() <= P + 1]
    if not seqs or short:
        raise ProfileError(f"calibration needs sequences longer than the prefix ({P} tokens) plus one; "
                           f"{'none given' if not seqs else f'sequence(s) {short} are too short'} "
                           f"(lower --prefix or lengthen --tokens)")
    if not 0 <= settings.delta_ppl_sequences <= len(seqs):
        raise ProfileError(f"delta-PPL runs on the first N calibration sequences: N must lie in 0..{len(seqs)}, "
                           f"got {settings.delta_ppl_sequences} (--delta-ppl)")
    objectives, weights = parse_objectives(settings.objectives, settings.objective_weights)
    if objectives != ("continuation",) and not held:
        raise ProfileError(f"the objectives {list(objectives)} are measured on held-out sequences, and none are given; "
                           f"give held-out sequences (--validate N) or leave the objectives out")
    geometry = geometry_of_model(model)
    check_head_losses(settings.head_losses, settings.ranks)
    bad_ranks = [r for r in settings.ranks if r is not None and not 1 <= r <= geometry.head_dim]
    if bad_ranks:
        raise ProfileError(f"--ranks: rank(s) {bad_ranks} outside 1..{geometry.head_dim} (the model's head dim)")
    rules = tuple(settings.rules) if settings.rules is not None else default_rules(registry)
    probing = [r for r in rules if _probes(registry, r)]
    unknown = sorted(set(settings.rule_params) - set(rules))
    if unknown:
        raise ProfileError(f"rule_params names rule(s) {unknown} that are not calibrated (rules: {list(rules)}); "
                           f"drop them or add the rules")
    configs = candidate_configs(rules, settings, registry)
    items = followups(objectives, held, P, tokenizer=tokenizer if tokenizer is not None else tokenizer_of(model),
                      registry=registry, seed=settings.seed, chunk_tokens=settings.reconstruction_chunk) if held else {}
    quantizer = registry.quantizer(settings.quantizer)(**settings.quantizer_params)
    digest = run_digest({"model": geometry.fingerprint, "settings": attrs.asdict(settings), "rules": rules,
                         "configs": [c.label for c in configs],
                         "tokens": [s.tolist() for s in seqs], "heldout": [s.tolist() for s in held]})
    ckpt = Checkpoint(checkpoint_dir, digest)

    # Only the data the calibrated rules declare is computed (query statistics need one RoPE per model:
    # models with per-layer-type RoPE, Gemma 3, calibrate the rules that need none).
    needs = tuple(needs_of_rules(registry, rules))
    rpairs = rank_pairs(settings.ranks)
    if rpairs:
        needs += (KV_BASES_NEED,)
    batches = [s.view(1, -1) for s in seqs]
    model_data = {need.key: compute_data(need, model, batches, tokenizer=tokenizer, run_probe=run_probe)
                  for need in needs}
    inv_freq, rope_scaling = rope_of_model(model)
    ctx = LayerContext(registry=registry, quantizer=quantizer, model_data=model_data,
                       rope_inv_freq=inv_freq, rope_scaling=rope_scaling, seed=settings.seed,
                       rule_params=settings.rule_params)
    L = geometry.num_layers
    saved = ("l2", "cosine", "entropy") + (("head_l2",) if settings.head_losses else ()) + (("delta_ppl",) if settings.delta_ppl_sequences else ()) + (
        tuple(METRIC_OF[o] for o in objectives) if held else ()) + (("rank_l2",) if rpairs else ()) + (
        tuple(f"{axis}_{METRIC_OF[o]}" for o in objectives for axis, on in (("rank", rpairs), ("pair", settings.pairs))
              if on) if held else ())
    uppers = pair_uppers(geometry) if settings.pairs else []
    done = {layer: dict(precomputed[layer]) if precomputed and layer in precomputed else
            ckpt.load(layer, required=saved) for layer in range(L)}
    todo = [layer for layer in range(L) if done[layer] is None and (layers is None or layer in layers)]
    hidden = any(signal_request([registry.rule(r)(**settings.rule_params.get(r, {})).new_state()]).attention_input
                 for r in rules)   # kvzap: the captures keep each layer's attention input
    captures = [capture_sequence(model, s, attention_inputs=hidden) for s in seqs] if todo or settings.pairs else []
    kl_cols = e2e.kl_columns(configs, settings.kl_configs) if held else []
    measured = _Items([it for o in objectives for it in items.get(o, ())], P)
    snapshots = below = plain = None
    refs = []
    if todo and held:
        plans = e2e.one_layer_plans(geometry, todo, configs, kl_cols, quantizer=settings.quantizer,
                                    quantizer_params=settings.quantizer_params)
        snapshots = e2e.PrefixSnapshots(model, measured.prefixes, plans, registry=registry, model_data=model_data)
        plain = snapshots.plain()
        # One follow-up forward of the full plan per item, restored from its prefix's plain prefill, gives both the
        # layer outputs below each measured layer and the reference distributions (no whole-sequence forward).
        below = [e2e.LayerOutputs(model, plain[k], it.ids, P, layers=todo, registry=registry, logits=True)
                 for it, k in zip(measured.items, measured.prompts)]
        refs = [e2e.KLReference.of_logits(b.logits, it.rows) for b, it in zip(below, measured.items)]
        for b in below:
            b.logits = None
    if todo and probing:  # a probe rule selects from the runtime's prefill of the calibration prefixes
        ctx.prefills = _probe_prefills(model, geometry, todo, probing, seqs, P, settings, registry, model_data)
    ppl_seqs = seqs[:settings.delta_ppl_sequences]
    ppl_refs = [val.reference_logprobs(model, s, P) for s in ppl_seqs] if todo else []

    axis_units = (len(rpairs) + bool(settings.pairs)) if held else 0
    units = _Units(len(todo) * (len(configs) + len(kl_cols) + axis_units), progress)
    try:
        for layer in todo:
            units.layer(layer)
            arrays = _layer(model, geometry, layer, captures, P, configs, rules, settings, ctx, measured, refs, kl_cols,
                            snapshots, ppl_seqs, ppl_refs, units.tick, below)
            if rpairs:
                arrays["rank_l2"] = np.asarray(layer_rank_errors(stack_layer(captures, layer), P, rpairs,
                                                                 model_data["kv_bases"], registry=registry))
            if held and (rpairs or settings.pairs):
                arrays.update(_axes_end_to_end(model, geometry, layer, rpairs, uppers, measured, refs, snapshots, below,
                                               plain, P, ctx, settings, units.tick))
            ckpt.save(layer, arrays)
            done[layer] = arrays
            if on_layer is not None:
                on_layer(layer)
    finally:
        units.close()

    if layers is not None:
        return CalibrationResult(profile=None, model_data=model_data, needs=needs, seconds=time.perf_counter() - start,
                                 arrays={layer: done[layer] for layer in layers})
    profile = _assemble(geometry, configs, rules, done, kl_cols, settings, corpus, len(seqs), len(held),
                        int(seqs[0].numel()), dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                        objectives=items, weights=weights)
    stacked = lambda key: np.stack([done[layer][key] for layer in range(L)])  # noqa: E731
    if rpairs:
        profile = with_ranks(profile, {name: stacked(f"rank_{name}") for name in profile.metrics if name != MIX_METRIC},
                             rpairs, quantizer)
    if settings.pairs:
        profile = attrs.evolve(profile, pairs=measure_pairs(geometry, captures, P))
        if held:  # the pair measured at its lower layer is the upper layer's row
            profile = pair_stats(profile, {METRIC_OF[o]: np.concatenate([[0.0], stacked(f"pair_{METRIC_OF[o]}")[:-1, 0]])
                                           for o in objectives})
    return CalibrationResult(profile=profile, model_data=model_data, needs=needs, seconds=time.perf_counter() - start)


def _axes_end_to_end(model, geometry, layer, rpairs, uppers, measured, refs, snapshots, below, plain, P, ctx,
                     settings, tick) -> dict[str, np.ndarray]:
    """The rank pairs on ``layer`` and the pair whose lower layer it is, measured end to end on every objective
    (:mod:`polykv.profiling.axes_endtoend`): ``rank_<metric>`` [len(rpairs)] and ``pair_<metric>`` [1] (0 when
    ``layer`` is no pair's lower layer)."""
    plans = [axes.rank_plan(geometry, layer, k, v) for k, v in rpairs]
    pair = layer + 1 in uppers
    if pair:
        plans.append(axes.pair_plan(geometry, layer + 1))
    per = axes.plans_kl(model, layer, plans, [it.ids for it in measured.items], refs, measured.prompts,
                        measured.prefixes, P, rows=[it.rows for it in measured.items], below=below, plain=plain,
                        model_data=ctx.model_data, registry=ctx.registry, seed=settings.seed, tick=tick)
    if settings.pairs and not pair:
        tick()
    kinds = np.array([it.kind for it in measured.items])
    out = {}
    for name in dict.fromkeys(kinds):
        mean = per[kinds == name].mean(axis=0)
        if rpairs:
            out[f"rank_{METRIC_OF[name]}"] = mean[:len(rpairs)]
        if settings.pairs:
            out[f"pair_{METRIC_OF[name]}"] = np.asarray([mean[-1] if pair else 0.0])
    return out


def _probe_prefills(model, geometry, layers, rules, seqs, P, settings, registry, model_data):
    """``prefills(layer, rule, params)`` of :class:`~polykv.profiling.sensitivity.LayerContext`: the calibration
    prefixes (one batch) prefilled through the runtime once per probe, the probe run as the session runs it."""
    plans = {layer: [val.one_layer_plan(geometry, layer, rule=r, keep=0.5, params=settings.rule_params.get(r, {}))
                     for r in rules] for layer in layers}
    snaps = e2e.PrefixSnapshots(model, [torch.stack([s[:P] for s in seqs])], plans, registry=registry,
                                model_data=model_data)

    def prefills(layer: int, rule: str, params: dict):
        return snaps.layer_snapshot(val.one_layer_plan(geometry, layer, rule=rule, keep=0.5, params=params), layer)

    return prefills


class _Items:
    """The follow-ups of every objective as one list, with their distinct prefixes (each prefilled once per variant)
    and the index of each item's prefix among them."""

    def __init__(self, items, prefix: int):
        self.items = list(items)
        index: dict[bytes, int] = {}
        self.prompts, self.prefixes = [], []
        for it in self.items:
            key = it.ids[:prefix].numpy().tobytes()
            if key not in index:
                index[key] = len(self.prefixes)
                self.prefixes.append(it.ids[:prefix].view(1, -1))
            self.prompts.append(index[key])

    def __bool__(self) -> bool:
        return bool(self.items)


def _layer(model, geometry, layer, captures, P, configs, rules, settings, ctx, held, refs, kl_cols, snapshots,
           ppl_seqs, ppl_refs, tick, below=None) -> dict[str, np.ndarray]:
    """Every table row of one layer."""
    cap = stack_layer(captures, layer)                  # every sequence as one batch row
    ref = full_reference(cap, P)
    heads: list | None = [] if settings.head_losses else None
    arrays = {"l2": np.asarray(layer_l2(cap, P, configs, ctx, reference=ref, tick=tick, heads=heads)),
              "cosine": np.asarray(rule_cosines(cap, P, rules, ctx, capacity=settings.stat_capacity, reference=ref)),
              "entropy": np.asarray([attention_entropy(cap, P)])}
    if heads is not None:
        arrays["head_l2"] = np.asarray(heads).T             # [Hkv, C]
    if ppl_seqs:
        arrays["delta_ppl"] = _delta_ppl(model, geometry, layer, rules, ppl_seqs, ppl_refs, settings, ctx)
    if held:  # every objective's follow-ups through one measurement; one table per objective
        per = e2e.layer_kl(model, geometry, layer, configs, kl_cols, [it.ids for it in held.items], refs, snapshots,
                           quantizer=settings.quantizer, quantizer_params=settings.quantizer_params,
                           model_data=ctx.model_data, registry=ctx.registry, seed=settings.seed, tick=tick,
                           below=below, rows=[it.rows for it in held.items], prompts=held.prompts, per_sequence=True)
        kinds = np.array([it.kind for it in held.items])
        for name in dict.fromkeys(kinds):
            arrays[METRIC_OF[name]] = per[kinds == name].mean(axis=0)
    return arrays


def _delta_ppl(model, geometry, layer, rules, seqs, refs, settings, ctx) -> np.ndarray:
    out = np.zeros(len(rules))
    for s, ref in zip(seqs, refs):
        base = val.perplexity(ref, s[settings.prefix:])
        for j, rule in enumerate(rules):
            plan = val.one_layer_plan(geometry, layer, rule=rule, capacity=settings.stat_capacity)
            lp = val.plan_logprobs(model, plan, s, settings.prefix, model_data=ctx.model_data, seed=settings.seed)
            out[j] += (val.perplexity(lp, s[settings.prefix:]) - base) / len(seqs)
    return out


def _assemble(geometry, configs, rules, done, kl_cols, settings, corpus, n_seq, n_held, tokens, *,
              dtype: str | None = None, objectives=None, weights=None) -> Profile:
    L = geometry.num_layers
    table = lambda key: np.stack([done[layer][key] for layer in range(L)])  # noqa: E731
    cap = settings.stat_capacity
    stats = {
        "cosine": StatTable(columns=rules, values=table("cosine"), higher_is_better=True, phase=settings.phase,
                            capacity=cap, description="cosine between the layer's mean attention-block output "
                            "(after o_proj, mean over follow-up tokens) with every prefix token kept and with the "
                            f"rule keeping {cap} prefix tokens, 16 bits; mean over calibration sequences"),
        "entropy": StatTable(columns=("entropy",), values=table("entropy"), higher_is_better=False,
                             description="mean entropy (nats) of the follow-up queries' causal attention over all "
                             "keys, over query heads, queries and calibration sequences"),
    }
    metrics = {"l2": table("l2")}
    note = []
    if "delta_ppl" in done[0]:
        stats["delta_ppl"] = StatTable(columns=rules, values=table("delta_ppl"), higher_is_better=False,
                                       phase=settings.phase, capacity=cap,
                                       description=f"perplexity of the follow-up tokens when only this layer runs "
                                       f"the rule at {cap} prefix tokens (runtime), minus the full model's")
    routing = None
    for name, items in (objectives or {}).items():
        if name != "continuation":
            metrics[METRIC_OF[name]], _ = e2e.compose_additive(
                configs, {c: table(METRIC_OF[name])[:, j] for j, c in enumerate(kl_cols)}, L)
            note.append(describe_objective(name, items))
            routing = routing or METRIC_OF[name]
    mixed = None
    if len(objectives or {}) > 1:
        mixed = dict(weights)
    if "kl" in done[0]:
        kl = table("kl")                                    # [L, len(kl_cols)]
        full_kl, composed = e2e.compose_additive(configs, {c: kl[:, j] for j, c in enumerate(kl_cols)}, L)
        metrics["kl"] = full_kl
        routing = "kl"
        note.append(e2e.describe(configs, kl_cols, composed, n_held, tokens - settings.prefix))
        picked = val.sample_configs([configs[c] for c in kl_cols], settings.validate_configs, settings.seed)
        cols = [kl_cols[j] for j in picked]
        stats["kl_sampled"] = StatTable(columns=tuple(configs[c].label for c in cols), values=full_kl[:, cols],
                                        higher_is_better=False, phase=settings.phase,
                                        description=f"KL(full || config applied to this layer only), nats, mean over "
                                        f"{n_held} held-out sequences and follow-up positions (runtime); a sample "
                                        f"of the measured columns of metric kl")
        corr = val.correlations(metrics["l2"][:, kl_cols], kl, seed=settings.seed)
        means = np.nanmean(corr, axis=0) if np.isfinite(corr).any() else (np.nan, np.nan)
        note.append(f"L2 vs KL over the {len(kl_cols)} measured configs: mean per-layer Pearson {means[0]:.3f}, "
                    f"Spearman {means[1]:.3f}")
        if np.isfinite(corr).all():
            stats["l2_kl_correlation"] = StatTable(columns=("pearson", "spearman"), values=corr,
                                                   higher_is_better=True, description="per-layer correlation "
                                                   "between the l2 metric and the measured columns of metric kl")
    if mixed is not None:
        metrics[MIX_METRIC] = mix_tables(metrics, mixed)
        routing = MIX_METRIC
        note.append(f"metric {MIX_METRIC} (the routing table): "
                    + " + ".join(f"{w:g} x {name}" for name, w in sorted(mixed.items())))
    heads = {"l2": table("head_l2")} if "head_l2" in done[0] else None
    if heads is not None:
        note.append("head_metrics l2: each config's l2 per KV head (that head's query group's output error alone)")
    prov = ProfileProvenance(dtype=dtype, corpus=corpus or f"{n_seq} sequences of {tokens} tokens", seed=settings.seed,
                             context_tokens=settings.prefix, versions=_versions(), created=now_iso(),
                             note="; ".join([f"{n_seq} calibration sequences of {tokens} tokens, prefix {settings.prefix}"
                                             f" compressed, {tokens - settings.prefix} follow-up queries; quantizer "
                                             f"{settings.quantizer}{dict(settings.quantizer_params) or ''}"] + note))
    return Profile(model=model_info(geometry), configs=configs, metrics=metrics, stats=stats, provenance=prov,
                   quantizer=settings.quantizer, quantizer_params=settings.quantizer_params, routing_metric=routing,
                   objective_weights=mixed, head_metrics=heads)
