"""lm-evaluation-harness model ``polykv``: every request runs under a plan through :func:`polykv.apply`.

Register it by importing this module (``polykv lm-eval`` does), then::

    polykv lm-eval --model polykv --model_args pretrained=default,plan=my.plan.json --tasks TASKS

or from Python ``lm_eval.simple_evaluate(model=PolykvLM(pretrained=..., plan=...), tasks=[...])``.
``pretrained`` is ``default`` (SmolLM2-135M-Instruct, offline) or a local Hugging Face model folder;
``plan`` a plan file or ``full`` (keep everything, 16-bit: the same scores as lm-eval's ``hf``).

How the context is compressed, per request type (the protocol of ``polykv study``):

* ``loglikelihood`` (and multiple choice, and ``loglikelihood_rolling`` windows): lm-eval gives the
  split. The *context* is prefilled and compressed by the plan (the prefill rule selects after the
  last prefill forward, then the kept tokens are quantized). The first continuation token is scored
  from that prefill's last logits; the rest of the continuation is teacher-forced through the
  compressed cache one token per decode forward (:func:`polykv.studies.fidelity.forced_logprobs`),
  so the decode rule may evict between tokens, as it would while generating that text.
* ``generate_until``: lm-eval gives one prompt string, no split. A task that names where its question
  starts, with ``polykv_question_marker: TEXT`` in its ``generation_kwargs``, gets the protocol of
  :func:`polykv.answer`: the prompt's tokens before the token holding the marker's last occurrence are
  the context, prefilled and compressed; the rest (the marker onwards) is fed through the compressed cache
  (:func:`polykv.runtime.answer.answer_from_context`). Without it the whole prompt is the context. Then
  tokens are generated greedily, one decode forward each, until a stop sequence, EOS or ``max_gen_toks``.
  Sampling is refused (the runtime's generation here is greedy).

Requests run one at a time (``batch_size`` 1: a plan cache holds one sequence). Measured resident KV
bytes (:meth:`polykv.runtime.Session.resident_bytes`, in the run's compute dtype, metadata apart) are
kept per request and reported under ``config.polykv`` of lm-eval's results (see :meth:`kv_summary`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

import polykv
from polykv.contract.model_data import needs_of_rules, side_file
from polykv.errors import DeviceFallbackWarning, PolykvError
from polykv.models.devices import check_device
from polykv.models.geometry import geometry_of_model
from polykv.models.local_folder import check_model_folder, is_model_name, load_by_name
from polykv.plan import Plan, full_plan, load_plan, validate_plan
from polykv.registry import get_registry
from polykv.runtime.answer import answer_from_context
from polykv.runtime.fork import forward
from polykv.studies.fidelity import forced_logprobs
from polykv.studies.runner import plan_model_data

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import stop_sequences_criteria
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the polykv lm-eval model needs lm-evaluation-harness: pip install "
                      "'polykv-compose[lm-eval]'") from exc

FULL = "full"
QUESTION_MARKER = "polykv_question_marker"
"""The ``generation_kwargs`` key of a ``generate_until`` task that names where its question starts."""


LM_EVAL_DEFAULT_DEVICE = "cuda:0"
"""The device lm-eval passes when its ``--device`` is not given."""
HF_ARGS = ("max_length", "max_batch_size", "add_bos_token", "truncation", "logits_cache", "prefix_token_id",
           "think_end_token", "enable_thinking", "chat_template_args")
"""lm-eval ``hf`` model arguments the polykv model passes on (``max_batch_size`` is moot: one request at a time)."""
OWN_ARGS = ("pretrained", "plan", "dtype", "device", "tokenizer", "profile", "batch_size")


def check_args(*, pretrained: Any = "default", plan: Any = FULL, dtype: Any = "float32", device: str | None = None,
               profile: Any = None, batch_size: Any = 1, **extra) -> str:
    """Check the polykv model's arguments that need no model (``polykv lm-eval`` runs this before lm-eval starts,
    :class:`PolykvLM` again): unknown arguments, batch size, device and dtype, the model folder, the profile and
    the plan file it serves. Returns the dtype's torch name."""
    unknown = sorted(set(extra) - set(HF_ARGS) - {"tokenizer"})
    if unknown:
        raise PolykvError(f"the polykv lm-eval model got unknown model argument(s) {', '.join(unknown)}; it accepts "
                          f"{', '.join(OWN_ARGS + HF_ARGS)} (docs/integrations.md)")
    if str(batch_size) != "1":
        raise PolykvError(f"the polykv lm-eval model runs one request at a time (a plan cache holds one "
                          f"sequence); got batch_size={batch_size}, pass batch_size 1")
    name = check_device(device or "cpu", dtype, device_option="model argument device",
                        dtype_option="model argument dtype")
    if (isinstance(pretrained, str) or hasattr(pretrained, "__fspath__")) and not is_model_name(str(pretrained)):
        check_model_folder(str(pretrained), weights=True)
    if profile is not None:
        if not os.path.isfile(str(profile)):
            raise PolykvError(f"profile={profile}: no such file; give the profile whose side files hold the plan's "
                              "per-model data, or leave profile out to compute that data on the offline corpus")
        if isinstance(plan, (str, os.PathLike)) and str(plan) != FULL:
            plan = load_plan(str(plan), registry=get_registry())
        check_profile(profile, None if plan is None or isinstance(plan, str) else plan, get_registry())
    return name


def check_profile(profile: Any, plan, registry) -> None:
    """``profile=`` is read for the per-model data beside it: refuse one whose side file a rule of ``plan`` (None:
    the full plan) reads is missing (the data would be computed instead, silently), or one nothing reads."""
    needs = [] if plan is None else needs_of_rules(registry, sorted(plan.rules_used()))
    unread = [need for need in needs if need.key not in plan.model_data]
    if not unread:
        raise PolykvError(f"profile={profile}: the plan reads no per-model data from beside a profile (none of its "
                          "rules needs any, or its model_data names every file), so the profile would go unread; "
                          "leave profile out")
    for need in unread:
        if not os.path.isfile(side_file(str(profile), need.suffix)):
            raise PolykvError(f"profile={profile}: no {need.description or need.key} beside it "
                              f"({side_file(str(profile), need.suffix)}); write it with polykv model-data, or leave "
                              "profile out to compute it on the offline corpus")


def load_pretrained(pretrained: Any, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer): ``"default"`` is SmolLM2-135M-Instruct, a name (``gemma3-270m``) that model; else a local
    Hugging Face model folder (checked: config, safetensors weights, tokenizer; never downloaded)."""
    return load_by_name(str(pretrained), dtype=dtype, device=device)


def resolve_plan(plan: Any, model):
    """A :class:`~polykv.plan.Plan` from a Plan, ``"full"`` or a plan file, checked against ``model``."""
    geometry = geometry_of_model(model)
    if isinstance(plan, Plan):
        validate_plan(plan, registry=polykv.get_registry(), geometry=geometry)
        return plan
    if plan is None or plan == FULL:
        return full_plan(geometry)
    return polykv.load_plan(str(plan), registry=polykv.get_registry(), geometry=geometry)


@register_model("polykv")
class PolykvLM(HFLM):
    """lm-eval's ``hf`` model with every request run under a polykv plan (module docstring)."""

    instances: list["PolykvLM"] = []
    """Every model made in this process, in order (``polykv lm-eval`` prints their KV bytes)."""

    def __init__(self, pretrained: Any = "default", plan: Any = FULL, dtype: str = "float32",
                 tokenizer: Any = None, profile: str | None = None, batch_size: int | str = 1,
                 device: str | None = None, **kwargs):
        by_name = isinstance(pretrained, (str, bytes)) or hasattr(pretrained, "__fspath__")
        if device == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
            warnings.warn(f"device {device} (lm-eval's default when --device is not given) is not available on this "
                          "machine: running on cpu; pass --device cpu to say so", DeviceFallbackWarning, stacklevel=2)
            device = "cpu"
        dtype = check_args(pretrained=pretrained, plan=plan, dtype=dtype, device=device, profile=profile,
                           batch_size=batch_size, **kwargs)
        if by_name:
            model, tok = load_pretrained(pretrained, dtype, device or "cpu")
            self.model_name = str(pretrained)
        else:
            model, tok, self.model_name = pretrained, tokenizer, type(pretrained).__name__
            if device is not None and torch.device(device) != next(model.parameters()).device:
                raise PolykvError(f"device={device}: the model passed as pretrained is on "
                                  f"{next(model.parameters()).device}; move it there first, or leave device out")
        if tokenizer is not None:
            tok = tokenizer
        self.plan = resolve_plan(plan, model)
        super().__init__(pretrained=model, tokenizer=tok, batch_size=1, **kwargs)
        self.plan_source = plan if isinstance(plan, str) else (self.plan.provenance.note or "Plan object")
        self.model_data = plan_model_data(model, self.tokenizer, [self.plan], profile)
        self._session()  # checks the plan against the model (stores, attention) before any request
        self.requests: list[dict[str, Any]] = []
        """Per request: type, context tokens, measured KV bytes after the context and at the end."""
        PolykvLM.instances.append(self)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's ``--model_args`` string plus its own settings (``--device``, ``--batch_size``, which it always
        passes, with defaults); a setting also given in ``--model_args`` is taken from there."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # -- helpers ------------------------------------------------------------------------------------
    def _session(self):
        return polykv.apply(self.model, self.plan, model_data=self.model_data)

    def _full_bytes(self, tokens: int) -> int:
        geo = geometry_of_model(self.model)
        elem = next(self.model.parameters()).element_size()
        return 2 * geo.num_layers * geo.num_kv_heads * geo.head_dim * tokens * elem

    def _record(self, kind: str, context: int, kv, end) -> None:
        self.requests.append({"type": kind, "context_tokens": context, "kv_bytes": kv.total,
                              "metadata_bytes": kv.metadata_total, "kv_bytes_end": end.total,
                              "full_kv_bytes": self._full_bytes(context)})

    # -- log-likelihood ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        from tqdm import tqdm

        out = []
        for cache_key, context_enc, continuation_enc in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                                             desc="Running loglikelihood requests (polykv)"):
            answer = self._score(context_enc, continuation_enc)
            out.append(answer)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return out

    def _score(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces it), under the plan."""
        if not context_enc or not continuation_enc:
            raise PolykvError("a loglikelihood request needs a non-empty context and continuation")
        whole = (context_enc + continuation_enc)[-(self.max_length + 1):]    # lm-eval's left truncation
        n = len(continuation_enc)
        ctx = torch.tensor([whole[:-n]], dtype=torch.long, device=self.device)
        cont = torch.tensor([whole[-n:]], dtype=torch.long, device=self.device)
        with torch.no_grad(), self._session() as session:
            first = session.prefill(ctx)
            kv = session.resident_bytes()
            rows = [torch.log_softmax(first.logits[0, -1:].float(), dim=-1)]      # predicts cont[0]
            if n > 1:
                rows += [lp for _, lp in forced_logprobs(session, cont, where="loglikelihood request")]
            end = session.resident_bytes()
        logprobs = torch.cat(rows)                                                # (n, V)
        target = cont[0].to(logprobs.device)
        self._record("loglikelihood", int(ctx.shape[1]), kv, end)
        total = float(logprobs.gather(1, target[:, None]).sum())
        return total, bool((logprobs.argmax(-1) == target).all())

    # -- generation ----------------------------------------------------------------------------------
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Greedy generation of one prompt ``context`` [1, T] under the plan: [1, T + new] token ids."""
        marker = generation_kwargs.pop(QUESTION_MARKER, None)
        mask = generation_kwargs.pop("attention_mask", None)
        if context.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            raise PolykvError("the polykv lm-eval model generates for one unpadded prompt at a time (batch_size 1)")
        if generation_kwargs.get("do_sample") or float(generation_kwargs.get("temperature", 0.0) or 0.0) > 0:
            raise PolykvError("the polykv lm-eval model decodes greedily; set do_sample: false (temperature 0) in "
                              "the task's generation_kwargs")
        eos = self.model.generation_config.eos_token_id
        eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
        criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], 1)
        if marker is not None:
            return self._generate_after_question(context, max_length, marker, frozenset(eos), criteria)
        ids = context
        with torch.no_grad(), self._session() as session:
            out = session.prefill(context)
            kv = session.resident_bytes()
            while ids.shape[1] < max_length:
                nxt = out.logits[:, -1:].argmax(-1)                               # (1, 1)
                ids = torch.cat([ids, nxt], dim=1)
                if int(nxt) in eos or bool(criteria(ids, None).all()) or ids.shape[1] >= max_length:
                    break
                out = forward(session, nxt)
            end = session.resident_bytes()
        self._record("generate_until", int(context.shape[1]), kv, end)
        return ids

    def _generate_after_question(self, context, max_length: int, marker: Any, eos: frozenset[int], criteria):
        """The prompt ``context`` [1, T] split where ``marker`` last starts: the part before it compressed, the
        rest fed through the compressed cache, then greedy generation (the protocol of :func:`polykv.answer`)."""
        cut = question_start(self.tokenizer, context[0].tolist(), marker)
        T = int(context.shape[1])
        if max_length <= T:
            return context

        def done(tokens: list[int]) -> bool:
            ids = torch.cat([context, torch.tensor([tokens], dtype=context.dtype, device=context.device)], dim=1)
            return bool(criteria(ids, None).all())

        with torch.no_grad(), self._session() as session:
            run = answer_from_context(session, context[:, :cut], context[:, cut:], max_new_tokens=max_length - T,
                                      stop=eos, done=done)
        self._record("generate_until", cut, run.context_bytes, run.end_bytes)
        return torch.cat([context, torch.tensor([run.tokens], dtype=context.dtype, device=context.device)], dim=1)

    # -- results -------------------------------------------------------------------------------------
    def kv_summary(self) -> dict[str, Any]:
        """Per request type: requests, mean context tokens, mean measured KV bytes (after the context and
        at the end), mean full-cache bytes of the same contexts and their ratio."""
        out: dict[str, Any] = {"plan": self.plan_source, "basis": "measured resident K/V bytes in the compute "
                               f"dtype ({next(self.model.parameters()).dtype}), metadata apart", "requests": {}}
        for kind in sorted({r["type"] for r in self.requests}):
            rows = [r for r in self.requests if r["type"] == kind]
            mean = {k: sum(r[k] for r in rows) / len(rows)
                    for k in ("context_tokens", "kv_bytes", "kv_bytes_end", "metadata_bytes", "full_kv_bytes")}
            mean["full_over_measured"] = mean["full_kv_bytes"] / mean["kv_bytes"] if mean["kv_bytes"] else None
            out["requests"][kind] = {"count": len(rows), **{f"mean_{k}" if k != "full_over_measured" else k: v
                                                            for k, v in mean.items()}}
        return out

    def kv_report(self) -> str:
        """:meth:`kv_summary` as a Markdown table."""
        s = self.kv_summary()
        lines = [f"polykv plan {s['plan']}: {s['basis']}", "",
                 "| requests | count | mean context tokens | mean KV bytes (context) | mean KV bytes (end) "
                 "| full cache bytes | full / measured |", "|---|---|---|---|---|---|---|"]
        for kind, r in s["requests"].items():
            ratio = f"{r['full_over_measured']:.2f}x" if r["full_over_measured"] else "-"
            lines.append(f"| {kind} | {r['count']} | {r['mean_context_tokens']:.1f} | {r['mean_kv_bytes']:,.0f} | "
                         f"{r['mean_kv_bytes_end']:,.0f} | {r['mean_full_kv_bytes']:,.0f} | {ratio} |")
        return "\n".join(lines)

    def get_model_info(self) -> dict:
        """Model facts lm-eval stores in ``results["config"]``; ``polykv`` holds :meth:`kv_summary`
        (no hub look-up, unlike ``hf``)."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype), "model_name": self.model_name,
                "polykv": self.kv_summary()}


def question_start(tokenizer, ids: list[int], marker: Any) -> int:
    """Index of the first question token of the prompt ``ids``: the token that holds the first character of
    ``marker``'s last occurrence in the decoded prompt (the tokens are lm-eval's, only where they are split)."""
    if not isinstance(marker, str) or not marker:
        raise PolykvError(f"generation_kwargs {QUESTION_MARKER}: expected the non-empty text that starts the "
                          f"question in every prompt of the task, got {marker!r}")
    text = tokenizer.decode(ids)
    at = text.rfind(marker)
    if at < 0:
        raise PolykvError(f"generation_kwargs {QUESTION_MARKER}={marker!r}: not in the prompt ending "
                          f"{text[-60:]!r}; make it the text every prompt of the task puts before its question")
    lo, hi = 1, len(ids)                     # the shortest prefix whose text reaches past the marker's start
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) > at:
            hi = mid
        else:
            lo = mid + 1
    if lo - 1 < 1:
        raise PolykvError(f"generation_kwargs {QUESTION_MARKER}={marker!r} starts the prompt, so it leaves no "
                          "context to compress; name the text before the question, not the prompt's start")
    return lo - 1
