"""What :func:`polykv.runtime.session.apply` checks before anything is patched: the model, then the plan against it.

**The model** (:func:`check_servable`, :func:`attention_modules`): which decoders the runtime can serve.

Served: decoders whose every layer is softmax attention over a per-head K/V cache, through the
transformers ``AttentionInterface``: full, sliding-window and chunked attention; GQA, MQA and plain
multi-head attention; logit softcapping and learned attention sinks. Refused, with one line naming the
model type, the reason and what is served:

* multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): the cache holds compressed latents,
  not per-head keys and values;
* differential attention (DiffLlama): each layer subtracts two softmax attentions;
* layers that keep recurrent, linear-attention or convolution state (Mamba, Falcon-H1, ...);
* layers that reuse another layer's K/V (KV sharing, Gemma 3n);
* layers with different KV head counts or head dims (one plan shape per model);
* bidirectional encoders loaded as causal LMs (BERT-style ``*ForCausalLM`` without ``is_decoder``);
* attention modules that compute attention themselves instead of dispatching through the
  ``AttentionInterface`` (BLOOM's and Falcon's ALiBi kernels): checked on the modules a session patches
  (:func:`attention_modules`).

**The plan**: its rules, phases, ranks, seed, stores and per-model data against the model, each refusal one line
naming the layer and field; and the per-model data a plan's rules read, found or computed (:func:`plan_model_data`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping

import torch

from polykv.contract.model_data import find_model_data, needs_of_rules, tokenizer_of
from polykv.contract.rules import SIGNAL_PREROPE_STATS
from polykv.errors import PlanError, RuntimeConfigError
from polykv.models.geometry import FULL, WINDOWED
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan import Plan
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.runtime.storage import new_store, quantizer_of

SERVED = ("decoders whose every layer is softmax attention over a per-head K/V cache (full, sliding-window or "
          "chunked; GQA, MQA or multi-head; optional logit softcapping or attention sinks) through the "
          "transformers AttentionInterface")
_ATTENTION_TYPES = (FULL, *WINDOWED)
_STATE_MODULES = ("Mamba", "Mixer", "GatedDeltaNet", "LinearAttention", "ShortConv", "RecurrentBlock", "Rwkv",
                  "SSM")

def refusal_reason(model) -> str | None:
    """Why the runtime cannot serve ``model`` (one clause), or None when it can."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "kv_lora_rank", None) is not None:
        return ("multi-head latent attention caches compressed latents (kv_lora_rank), not per-head keys and "
                "values that a plan could select or quantize")
    if hasattr(config, "lambda_std_dev") or any(type(m).__name__.startswith("DiffLlama") and
                                                type(m).__name__.endswith("Attention") for m in model.modules()):
        return "differential attention subtracts two softmax attentions per layer"
    types = [str(t) for t in (getattr(config, "layer_types", None) or [])]
    other = sorted({t for t in types if t not in _ATTENTION_TYPES + ("mlp", "moe")})
    if other:
        return f"its {', '.join(other)} layers keep state that is not a per-head K/V cache"
    stateful = sorted({type(m).__name__ for m in model.modules()
                       if any(word in type(m).__name__ for word in _STATE_MODULES)})
    if stateful:
        return f"its layers keep recurrent, linear-attention or convolution state ({', '.join(stateful[:3])})"
    shared = getattr(config, "num_kv_shared_layers", None) or getattr(config, "kv_sharing_modes", None)
    if shared:
        return "some layers reuse another layer's keys and values (KV sharing)"
    if getattr(config, "is_heterogeneous", False):
        return "its layers differ in KV heads or head dim, and a plan has one shape for every layer"
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    if attention and not any(bool(m.is_causal) for m in attention):
        return "its attention is bidirectional (an encoder), not causal"
    return None

def attention_bypasses_interface(module) -> bool:
    """True when an attention module's (or attention class's) ``forward`` computes attention itself, never through
    transformers' ``ALL_ATTENTION_FUNCTIONS`` (BLOOM; Falcon up to transformers 5.24): polykv's attention function
    would never run there."""
    return _forward_bypasses((module if isinstance(module, type) else type(module)).forward)

@functools.lru_cache(maxsize=256)
def _forward_bypasses(forward) -> bool:
    """:func:`attention_bypasses_interface` of one ``forward`` function: its source is read once per process (reading
    it took 5 ms per layer, and calibration opens a session for each of hundreds of one-layer plans)."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False  # no source to read: the runtime's per-forward check still catches it
    return "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source

def attention_modules(model, num_layers: int) -> list[torch.nn.Module]:
    """The self-attention module of every layer: the first ``*Attention`` module that knows its ``layer_idx``."""
    found: dict[int, torch.nn.Module] = {}
    for _, m in model.named_modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and type(m).__name__.endswith("Attention") \
                and not getattr(m, "is_cross_attention", False):
            found.setdefault(idx, m)
    if sorted(found) != list(range(num_layers)):
        raise RuntimeConfigError(
            f"model type '{model_type(model)}' cannot be served by polykv: found attention modules for layers "
            f"{sorted(found)}, expected 0..{num_layers - 1}; supported are {SERVED}")
    bypass = [i for i in range(num_layers) if attention_bypasses_interface(found[i])]
    if bypass:
        raise RuntimeConfigError(
            f"model type '{model_type(model)}' cannot be served by polykv: {type(found[bypass[0]]).__name__} "
            f"computes attention itself instead of dispatching through the transformers AttentionInterface; "
            f"supported are {SERVED}")
    return [found[i] for i in range(num_layers)]

def check_servable(model) -> None:
    """Raise :class:`RuntimeConfigError` (one line) when :func:`refusal_reason` finds a reason."""
    reason = refusal_reason(model)
    if reason is not None:
        raise RuntimeConfigError(f"model type '{model_type(model)}' cannot be served by polykv: {reason}; "
                                 f"supported are {SERVED}")

def model_type(model) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return str(getattr(config, "model_type", type(model).__name__))

def plain_softmax(module) -> bool:
    """Whether attention module ``module`` computes a plain softmax: no logit softcapping (Gemma 2's
    ``attn_logit_softcapping``) and no learned sinks (gpt-oss's ``sinks``). Decided once, by :func:`polykv.apply`."""
    return getattr(module, "attn_logit_softcapping", None) is None and getattr(module, "sinks", None) is None

# -- the plan against the model -------------------------------------------------------------------------------

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
