"""The family matrix: every causal-LM family of the installed transformers, tiny, checked under polykv.

For each model type of transformers' causal-LM registry, :func:`check_family` builds a tiny random
model (2 layers, hidden 64, 4 heads, windows and chunks of 8 tokens, so a 20-token prompt crosses
them) and sorts it into one of:

* ``served``: the keep-everything plan reproduces vanilla transformers (prompt logits and greedy
  decoding, within :data:`TOL`), and a compressed plan (SnapKV prefill + H2O decode) equals the masked
  full-cache reference of :mod:`polykv.models.reference`;
* ``refused``: :func:`polykv.apply` refuses it before anything is patched, with a one-line message
  naming the model type, the reason and what is served;
* ``not a decoder``: encoder-decoder, composite (multimodal: its text model is listed on its own)
  or bidirectional encoder families;
* ``not built``: no tiny configuration of it runs in vanilla transformers here (the reason is kept).

``python scripts/family_table.py`` prints the table; ``tests/models/test_family_matrix.py`` asserts it.
"""

from __future__ import annotations

import attrs
import torch

from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_from_config, geometry_of_model
from polykv.models.reference import masked_reference_logits, record_run
from polykv.plan import OpSpec, full_plan, uniform_plan
from polykv.runtime.cache import cache_keyword, output_cache
from polykv.runtime.session import apply
from polykv.runtime.checks import attention_bypasses_interface, check_servable

TOL = 1e-4
PROMPT, STEPS, WINDOW = 20, 6, 8
MAX_PARAMS = 3_000_000
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=WINDOW,
            attention_chunk_size=WINDOW, pad_token_id=0)
TINY_MOE = dict(num_experts=2, num_local_experts=2, n_routed_experts=2, moe_num_experts=2, num_experts_per_tok=1,
                moe_k=1, moe_topk=1, n_shared_experts=1, n_group=1, topk_group=1, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, expert_intermediate_size=32)
TINY.update(TINY_MOE)
"""Tiny values for the config fields a family has (a field the config lacks is never added); mixtures of
experts get two experts, one routed per token."""
ALWAYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
OVERRIDES = {
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    "falcon": {"head_dim": None},
    "nemotron": {"partial_rotary_factor": 0.5},
    "gpt_oss": {"num_local_experts": 2, "num_experts_per_tok": 1},
    "deepseek_v2": {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
    "deepseek_v3": {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
}
"""Per family fields that the generic tiny values leave inconsistent."""


@attrs.define(frozen=True)
class FamilyResult:
    """One row of the family table."""

    model_type: str
    status: str
    """``served``, ``refused``, ``not a decoder``, ``not built`` or ``error`` (polykv raised something else)."""
    full_diff: float | None = None
    """Max |logit difference| of the full plan against vanilla (prompt and every greedy step)."""
    masked_diff: float | None = None
    """Max |logit difference| of the compressed plan against the masked full-cache reference."""
    message: str = ""
    """The refusal, or why the family is not in the served/refused rows."""
    attention: str = ""
    """Attention types and variants of the tiny model (e.g. ``sliding+full, softcap``)."""


def model_types() -> list[str]:
    """Every model type in the installed transformers' causal-LM registry, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The tiny config of ``model_type``, or a string saying why there is none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
        base = cls()
    except Exception as exc:  # noqa: BLE001 - any failure means "no tiny config", reported verbatim
        return f"default config fails: {type(exc).__name__}: {_line(exc)}"
    if getattr(base, "is_encoder_decoder", False):
        return "not a decoder: encoder-decoder"
    try:
        if base.get_text_config() is not base:
            return "not a decoder: composite config (its text model type is listed on its own)"
    except ValueError:
        return "not a decoder: composite config with several text configs"
    kwargs = {k: v for k, v in TINY.items() if k in ALWAYS or _has(base, k)}
    types = getattr(base, "layer_types", None) or []
    if {"sliding_attention", "full_attention"} <= set(types):
        kwargs["layer_types"] = ["sliding_attention", "full_attention"]  # a hybrid model keeps both kinds
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        return f"tiny config rejected: {type(exc).__name__}: {_line(exc)}"


def _has(config, name: str) -> bool:
    try:
        return getattr(config, name, None) is not None
    except Exception:  # noqa: BLE001 - per-layer attributes of heterogeneous configs raise on global access
        return True


def _line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__


def build(model_type: str, *, device: str = "cpu"):
    """(model, None) for a tiny random ``model_type`` (sdpa, else eager attention), or (None, why not)."""
    import transformers

    config = tiny_config(model_type)
    if isinstance(config, str):
        return None, config
    try:
        with torch.device("meta"):
            probe = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001
        return None, f"model class fails: {type(exc).__name__}: {_line(exc)}"
    if device == "meta":
        return probe.eval(), None
    n = sum(p.numel() for p in probe.parameters())
    if n > MAX_PARAMS:
        return None, f"tiny config still has {n / 1e6:.1f}M parameters (limit {MAX_PARAMS / 1e6:.0f}M)"
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        try:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except ValueError as exc:
            if "does not support" in str(exc) and attn == "sdpa":
                continue
            return None, f"model class fails: {type(exc).__name__}: {_line(exc)}"
        except Exception as exc:  # noqa: BLE001
            return None, f"model class fails: {type(exc).__name__}: {_line(exc)}"
        model.generation_config.eos_token_id = None
        return model, None
    return None, "no sdpa or eager attention"


def _prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 128), (1, length), generator=g)


def _vanilla(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits of every prompt position and of ``steps`` greedy steps with transformers' own cache."""
    out = model(ids, use_cache=True)
    cache = output_cache(out)
    logits = [out.logits]
    for _ in range(steps):
        tok = logits[-1][:, -1:].argmax(-1)
        out = model(tok, use_cache=True, **{cache_keyword(model): cache})
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _bidirectional(model) -> bool:
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    return bool(attn) and not any(bool(m.is_causal) for m in attn)


def _describe(model, geo) -> str:
    kinds = "+".join(sorted({t.replace("_attention", "") for t in geo.layer_types})) or "full"
    cfg = model.config
    extra = []
    if getattr(cfg, "attn_logit_softcapping", None):
        extra.append("softcap")
    if any(hasattr(m, "sinks") for m in model.modules()):
        extra.append("sinks")
    extra.append("MHA" if geo.num_kv_heads == geo.num_heads else "MQA" if geo.num_kv_heads == 1 else "GQA")
    return ", ".join([kinds] + extra)


def falcon_computes_attention_itself() -> bool:
    """Whether the installed transformers' Falcon attention computes attention itself (up to 5.24: polykv refuses
    it) rather than through the attention interface (from 5.25: served like any other family)."""
    from transformers.models.falcon import modeling_falcon

    return attention_bypasses_interface(modeling_falcon.FalconAttention)


def check_family(model_type: str) -> FamilyResult:
    """Build ``model_type`` tiny and sort it (see the module docstring); exactness is measured, not assumed."""
    model, why = build(model_type)
    if model is None:
        meta, _ = build(model_type, device="meta") if "parameters" in why else (None, None)
        if meta is None:
            return FamilyResult(model_type, "not a decoder" if why.startswith("not a decoder") else "not built",
                                message=why)
        model = meta  # too big to run tiny: only whether apply refuses it can be checked
    if _bidirectional(model):
        return FamilyResult(model_type, "not a decoder", message="not a decoder: bidirectional encoder")
    try:
        check_servable(model)
        if next(model.parameters()).device.type == "meta":
            return FamilyResult(model_type, "not built", message=why)
        with apply(model, full_plan(geometry_from_config(model.config))):
            pass
    except RuntimeConfigError as exc:
        return FamilyResult(model_type, "refused", message=str(exc))
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 128))
    ids = _prompt(vocab, PROMPT, seed=1)
    try:
        with torch.no_grad():
            ref = _vanilla(model, ids, STEPS)
    except Exception as exc:  # noqa: BLE001
        return FamilyResult(model_type, "not built", message=f"vanilla forward fails: {type(exc).__name__}: "
                                                             f"{_line(exc)}")
    geo = geometry_of_model(model)
    try:
        with torch.no_grad(), apply(model, full_plan(geo)) as session:
            got = torch.cat([session.prefill(ids).logits] + _greedy(model, session, ref, ids, STEPS), dim=1)
        full = float((got - ref).abs().max())
        plan = uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=6, params={"window": 2}),
                                   decode=OpSpec(rule="h2o", capacity=5), decode_slack=1)
        run = record_run(model, plan, ids, continuation=_prompt(vocab, 3, seed=2), steps=STEPS)
        masked = float((run.logits - masked_reference_logits(model, run)).abs().max())
    except RuntimeConfigError as exc:
        return FamilyResult(model_type, "refused", message=f"at the first forward: {exc}")
    except Exception as exc:  # noqa: BLE001 - a traceback under polykv is a failure the table must show
        return FamilyResult(model_type, "error", message=f"{type(exc).__name__}: {_line(exc)}")
    return FamilyResult(model_type, "served", full_diff=full, masked_diff=masked, attention=_describe(model, geo))


def _greedy(model, session, ref, ids, steps):
    """The full plan's logits for the same greedy tokens vanilla chose (teacher-forced on vanilla's argmax)."""
    out, T = [], ids.shape[1]
    for i in range(steps):
        tok = ref[:, T - 1 + i:T + i].argmax(-1)
        out.append(model(tok, use_cache=True, **{session.cache_keyword: session.cache}).logits)
    return out


def family_table(results) -> str:
    """Markdown table: family | full == vanilla | compressed == masked | refused with message."""
    lines = ["| family | attention | full == vanilla | compressed == masked | refused with message |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        if r.status == "served":
            ok = lambda d: f"yes ({d:.1e})" if d < TOL else f"**NO** ({d:.1e})"  # noqa: E731
            lines.append(f"| {r.model_type} | {r.attention} | {ok(r.full_diff)} | {ok(r.masked_diff)} | - |")
        elif r.status == "refused":
            lines.append(f"| {r.model_type} | | - | - | {r.message.replace('|', '/')} |")
        else:
            lines.append(f"| {r.model_type} | | - | - | ({r.status}: {r.message.replace('|', '/')}) |")
    return "\n".join(lines)
