"""What :func:`polykv.runtime.session.apply` checks before anything is patched: a plan's rules, phases, ranks,
seed, stores and per-model data against the model, each refusal one line naming the layer and field; and the
per-model data a plan's rules read, found or computed (:func:`plan_model_data`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from polykv.contract.model_data import find_model_data, needs_of_rules, tokenizer_of
from polykv.contract.rules import SIGNAL_PREROPE_STATS
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.plan import Plan
from polykv.runtime.storage import new_store, quantizer_of
from polykv.runtime.support import SERVED, model_type


def check_probe_phases(plan: Plan, registry) -> None:
    """A rule that runs a probe after the prompt (:mod:`polykv.contract.probe`) serves only the prefill op:
    in decode there is no prompt left to probe."""
    for lp in plan.layers:
        op = lp.decode
        if op.keeps_everything or not registry.has("rule", op.rule):
            continue
        if registry.rule(op.rule).declares_probe():
            raise PlanError(f"rule '{op.rule}' runs a probe (a model pass after the prompt, before selection), and "
                            f"decode has no prompt to probe", layer=lp.layer, field=f"layers[{lp.layer}].decode.rule",
                            hint="use it in the prefill op and give decode another rule (or full)")


def check_rank_rules(plan: Plan, registry) -> None:
    """A layer storing key codes (``k_rank``) holds no post-RoPE keys: a rule that undoes or redoes RoPE on them
    (its ``reads_rope``, or pre-RoPE key statistics) cannot score it."""
    for lp in plan.layers:
        if lp.k_rank is None:
            continue
        for phase in ("prefill", "decode"):
            op = getattr(lp, phase)
            if op.keeps_everything or not registry.has("rule", op.rule):
                continue
            cls = registry.rule(op.rule)
            if getattr(cls, "reads_rope", False) or cls.signal == SIGNAL_PREROPE_STATS:
                raise PlanError(f"rule '{op.rule}' reads keys in RoPE coordinates, but this layer stores key codes "
                                f"(k_rank {lp.k_rank})", layer=lp.layer, field=f"layers[{lp.layer}].k_rank",
                                hint="remove the layer's k_rank, or choose a rule that scores keys by attention, "
                                     "norms or similarity")


SEED_RANGE = (0, 2 ** 64 - 1)
"""Seeds a torch generator accepts (both ends included)."""


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RuntimeConfigError(f"apply(seed=...) must be an integer in [{SEED_RANGE[0]}, 2**64 - 1] (it seeds the "
                                 f"generator of sampling rules), got {seed!r}; pass e.g. seed=0")


def check_model_data(model_data, plan: Plan, registry, model) -> None:
    """``model_data`` maps names to data; what the plan's rules declare they read must be that data."""
    if model_data is None:
        return
    if not isinstance(model_data, Mapping) or not all(isinstance(k, str) for k in model_data):
        raise RuntimeConfigError(f"apply(model_data=...) must be a dict from the data keys the plan's rules declare "
                                 f"to their per-model data, e.g. {{key: QueryStats.load(path)}}, got "
                                 f"{type(model_data).__name__}")

    for need in plan_needs(plan, registry):
        data = model_data.get(need.key)
        if data is None or need.check is None:
            continue
        what = need.description or "per-model data"
        try:
            need.check(data, model)
        except (AttributeError, TypeError):
            raise RuntimeConfigError(
                f"apply(model_data=...): model_data['{need.key}'] is a {type(data).__name__}, not the {what} the "
                f"plan's rules read; pass the object calibration saved beside the profile (see docs/calibration.md)"
            ) from None
        except ValueError as exc:
            raise RuntimeConfigError(f"apply(model_data=...): model_data['{need.key}']: {exc}") from None


def plan_model_data(model, plan: Plan, registry, geometry, *, given: Mapping[str, Any] | None = None,
                    tokenizer=None, missing: str = "compute", run_probe=None) -> dict[str, Any]:
    """The per-model data ``plan``'s rules read (see :func:`apply`), by key (``run_probe``: the runtime's probe
    runner, for data measured through a probe)."""
    rules = sorted(plan.rules_used())
    given = {k: v for k, v in (given or {}).items() if v is not None}
    needs = [n for n in plan_needs(plan, registry) if n.key not in given]
    if not needs:
        return given
    files = {k: [(path, f"plan field model_data.{k}")] for k, path in plan.model_data.items()}
    used_by = {}
    for need in needs:
        if need.key == KV_BASES_KEY:
            used_by[need.key] = f"the ranks of layers {layer_spans([lp.layer for lp in plan.layers if lp.low_rank])}"
            continue
        names = [r for r in rules if getattr(registry.rule(r), "model_data_need", None) is need]
        layers = [lp.layer for lp in plan.layers if {lp.prefill.rule, lp.decode.rule} & set(names)]
        used_by[need.key] = f"rule {', '.join(repr(n) for n in names)} (layers {layer_spans(layers)})"
    if tokenizer is None and missing == "compute":
        tokenizer = tokenizer_of(model)
    return find_model_data(model, needs, given=given, files=files, tokenizer=tokenizer, missing=missing,
                           fingerprint=geometry.fingerprint, used_by=used_by, run_probe=run_probe)


def plan_needs(plan: Plan, registry) -> list:
    """The per-model data ``plan`` reads: its rules' (:func:`polykv.contract.model_data.needs_of_rules`), and the
    key/value bases when a layer has a rank (:data:`polykv.plan.bases_need.KV_BASES_NEED`)."""
    needs = needs_of_rules(registry, sorted(plan.rules_used()))
    return needs + [KV_BASES_NEED] if plan.low_rank else needs


def layer_spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def check_stores(plan: Plan, registry, geometry, dtype: torch.dtype) -> None:
    """Build every quantized layer's stores on an empty [1, Hkv, 0, d] chunk, so that a quantizer that
    cannot serve this head dim fails here, naming the layer, rather than in the middle of a forward."""
    seen = set()
    for lp in plan.layers:
        if not lp.quantized:
            continue
        key = (lp.quantizer, repr(sorted(lp.quantizer_params.items())), lp.k_bits, lp.v_bits, lp.k_rank, lp.v_rank)
        if key in seen:
            continue
        seen.add(key)
        quantizer = quantizer_of(registry, lp)
        for stream in ("key", "value"):
            width = lp.rank_of(stream, geometry.head_dim)  # a low-rank stream's quantizer codes r-wide codes
            empty = torch.zeros(1, geometry.num_kv_heads, 0, width, dtype=dtype)
            rank = "k_rank" if stream == "key" else "v_rank"
            try:
                new_store(quantizer, lp, stream, dtype=dtype, device=empty.device).append(empty)
            except ValueError as exc:
                if width != geometry.head_dim:
                    raise PlanError(f"{stream} store of {width}-channel codes: {exc}", layer=lp.layer,
                                    field=f"layers[{lp.layer}].{rank}",
                                    hint=f"choose a {rank} the quantizer's groups divide, or other quantizer_params")\
                        from None
                raise PlanError(f"{stream} store: {exc}", layer=lp.layer, field=f"layers[{lp.layer}].quantizer_params",
                                hint=f"choose parameters that fit head_dim {geometry.head_dim}") from None


def check_layer_shapes(model, modules, geometry) -> None:
    """Every layer's key projection must produce the geometry's ``num_kv_heads x head_dim`` (one plan shape)."""
    want = geometry.num_kv_heads * geometry.head_dim
    for i, m in enumerate(modules):
        proj = getattr(m, "k_proj", None)
        out = getattr(proj, "out_features", None)
        if isinstance(out, int) and out != want:
            raise RuntimeConfigError(
                f"model type '{model_type(model)}' cannot be served by polykv: layer {i} projects keys to {out} "
                f"values but the config says {geometry.num_kv_heads} KV heads x {geometry.head_dim}: its layers differ "
                f"in KV heads or head dim, and a plan has one shape for every layer; supported are {SERVED}")
