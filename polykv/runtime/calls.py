"""The calls a session serves inside its ``with`` block besides the model's forwards: ``generate`` and ``prefill``.

``model.generate`` is replaced by :func:`generate` (a fresh plan cache unless one is passed; ``use_cache=False``
only for a plan that keeps everything), and ``session.prefill`` is :func:`prefill` (a fresh cache filled in
chunks); both claim the session for their thread (:class:`~polykv.runtime.session.OneCaller`) and run the model's
guarded forward (:meth:`~polykv.runtime.session.Session.guarded_forward`). :func:`note_context` warns
(:class:`ContextLengthWarning`, once per plan) when a plan's absolute capacities meet another context length than
the one it was budgeted for.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Mapping

import torch

from polykv.errors import RuntimeConfigError
from polykv.attention.attach import refuse_padding
from polykv.memory import context_note
from polykv.runtime.cache import given_cache

_NOTED: set = set()


class ContextLengthWarning(UserWarning):
    """A plan with absolute token capacities runs on a context other than the one it was budgeted for."""


def uses_cache(model, kwargs: Mapping[str, Any]) -> bool:
    """Whether ``generate(**kwargs)`` runs with a cache: its ``use_cache`` argument, else that of the
    ``generation_config`` it was given, else the model's ``generation_config``."""
    if kwargs.get("use_cache") is not None:
        return bool(kwargs["use_cache"])
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "use_cache", True) is not False


UNSUPPORTED_GENERATE = {
    "assistant_model": "assisted decoding crops the cache back after each draft, and a plan cache cannot be cropped",
    "prompt_lookup_num_tokens": "prompt lookup decoding crops the cache back after each draft, and a plan cache "
                                "cannot be cropped",
    "assistant_early_exit": "self-speculative decoding crops the cache back after each draft, and a plan cache "
                            "cannot be cropped",
    "cache_implementation": "the plan's cache is the cache: generate() cannot build another one",
}
"""``generate()`` arguments a plan cannot serve, and why (:func:`refuse_unsupported_modes`)."""


def refuse_unsupported_modes(model, kwargs: Mapping[str, Any]) -> None:
    """One :class:`RuntimeConfigError` line for a ``generate()`` mode a plan cannot serve (assisted or prompt-lookup
    decoding, ``cache_implementation``, beam search), set as an argument or in the generation config, before the
    model runs (transformers would otherwise blame a cache the caller never passed)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name, why in UNSUPPORTED_GENERATE.items():
        value = kwargs.get(name, getattr(config, name, None) if name != "assistant_model" else None)
        if value is not None:
            where = f"generate({name}=...)" if name in kwargs else f"the generation config's {name}"
            raise RuntimeConfigError(f"{where} is not supported under a polykv plan: {why}; generate without it "
                                     f"inside polykv.apply, or run that mode outside the with-block")
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
    if beams is not None and beams != 1:
        where = "generate(num_beams=...)" if "num_beams" in kwargs else "the generation config's num_beams"
        raise RuntimeConfigError(f"{where} = {beams}: beam search is not supported under a polykv plan (its layers "
                                 f"hold different tokens, so beams cannot be reordered); use greedy or sampled "
                                 f"decoding (num_beams=1) inside polykv.apply")


def check_chunk_size(chunk_size: Any, where: str) -> None:
    """Refuse a ``chunk_size`` that is not None or a positive whole number of tokens (``where``: the call)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise RuntimeConfigError(f"{where}(chunk_size=...) must be a positive whole number of tokens, or None for "
                                 f"one forward over the whole prompt; got {chunk_size!r}")


def generate(session, *args, **kwargs):
    """``model.generate`` inside ``session``'s block."""
    session.require_active()
    with session.one_caller.claim("generate()"):
        return _generate_one(session, *args, **kwargs)


def _generate_one(session, *args, **kwargs):
    model = session.model
    refuse_unsupported_modes(model, kwargs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        note_context(session, ids.shape[1])
    if session.probe is not None and isinstance(ids, torch.Tensor):
        session.probe.chunks_for(ids)  # a probe that cannot run is refused before the model runs
    refuse_padding(kwargs.get("attention_mask"))
    given = given_cache(kwargs, session.cache_keyword)
    if not uses_cache(model, kwargs):
        return _generate_uncached(session, given, *args, **kwargs)
    if given is None:
        kwargs[session.cache_keyword] = session.new_cache()
    elif given is not session.cache:
        raise RuntimeConfigError("generate() got a cache that is not this session's live cache; pass "
                                 "session.cache or session.new_cache(), or no cache at all")
    return type(model).generate(model, *args, **kwargs)


def _generate_uncached(session, given, *args, **kwargs):
    """``generate`` with ``use_cache=False``: vanilla semantics (every step recomputes the whole sequence)
    for a plan that keeps everything at 16 bits; refused for any other plan, which has nothing to compress."""
    fix = ("pass use_cache=True to generate(), or set model.generation_config.use_cache = True (some "
           "checkpoints' generation_config.json say false), or generate outside polykv.apply")
    if not session.plan.keeps_everything:
        raise RuntimeConfigError(f"generate() runs with use_cache=False, but a plan compresses the KV cache and "
                                 f"without a cache there is nothing to compress: {fix}")
    if given is not None:
        raise RuntimeConfigError(f"generate() got a cache and use_cache=False (a cache it would not use): {fix}")
    session.uncached_thread = threading.get_ident()
    try:
        return type(session.model).generate(session.model, *args, **kwargs)
    finally:
        session.uncached_thread = None


def prefill(session, input_ids: torch.Tensor, *, chunk_size: int | None = None, **model_kwargs):
    """Prefill a fresh cache of ``session`` with ``input_ids`` [B, T], in chunks of ``chunk_size`` tokens.

    Selection runs once, after the last chunk, exactly as for an unchunked prefill. Returns the
    model output of the last chunk (its ``logits`` [B, chunk, vocab]); the cache is ``session.cache``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.is_complex():
        tensor = isinstance(input_ids, torch.Tensor)
        got = (f"a {input_ids.dim()}-D {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}" if tensor
               else f"a {type(input_ids).__name__}")
        fix = ("for one prompt pass ids[None] (shape [1, tokens])" if tensor and input_ids.dim() == 1
               else "pass the tokenizer's input_ids, e.g. tokenizer(text, return_tensors='pt').input_ids")
        raise RuntimeConfigError(f"prefill(input_ids) needs token ids as an integer tensor [batch, tokens], got "
                                 f"{got}: {fix}")
    T = input_ids.shape[1]
    if T < 1:
        raise RuntimeConfigError("prefill got no tokens (input_ids has length 0): give a non-empty prompt")
    check_chunk_size(chunk_size, "prefill")
    step = chunk_size or T
    if session.probe is not None:
        session.probe.chunks_for(input_ids)  # a probe that cannot run is refused before the model runs
    with session.one_caller.claim("prefill()"):
        cache = session.new_cache()
        note_context(session, T)
        out = None
        for start in range(0, T, step):
            cache.prefill_continues = start + step < T
            out = session.model(input_ids[:, start:start + step], use_cache=True,
                                **{session.cache_keyword: cache}, **model_kwargs)
        cache.prefill_continues = False
    return out



def note_context(session, context_tokens: int) -> None:
    """Warn once per plan (one line, with the real ratio) when absolute capacities meet another context length."""
    plan = session.plan
    key = id(plan)
    if key in _NOTED:
        return
    note = context_note(plan, int(context_tokens), registry=session.registry)
    if note:
        _NOTED.add(key)
        warnings.warn(note, ContextLengthWarning, stacklevel=3)
