"""Compress a context once, answer questions from it: the evaluation protocol as one call.

:func:`answer` prefills the *context*, compresses it with the plan (the prefill rule selects after the
last prefill forward, the kept tokens are quantized), THEN feeds each *question* through the compressed
cache in one forward and generates greedily. The first answer token is computed from the compressed
cache; had the question been part of the prefill, the prefill rule would have seen it, and scores would
flatter the method. Every question starts from the same compressed context, never from an earlier
question's answer: with several questions the model runs over the context once
(:func:`polykv.runtime.fork.capture_prefill`) and each question's cache is restored from that snapshot,
which is exact (the same tokens and bytes as a prefill per question).

Token ids follow the prompt rule of :mod:`polykv.runtime.prompt`: the context starts with the tokenizer's
leading special tokens (its BOS, where it adds one), the question continues without a second BOS, and
``prompt_format="chat"`` wraps both in the chat template, split right after the context.

:func:`compress_context`, :func:`generate_answer` and :func:`answer_from_context` are the steps, on token
ids inside a session; ``polykv study`` runs every item through them, so a study's answer and
:func:`answer`'s are one code path.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from polykv.errors import RuntimeConfigError
from polykv.plan import Plan
from polykv.registry import get_registry
from polykv.runtime.calls import check_chunk_size
from polykv.runtime.fork import capture_prefill, forward, restore_prefill
from polykv.runtime.prompt import PromptEncoder
from polykv.runtime.session import ResidentBytes, apply
from polykv.runtime.tokenizer_params import fill_tokenizer_params


def stop_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end a generation: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models end a turn with their own token, e.g. Gemma's ``<end_of_turn>``)."""
    ids = set()
    cfg = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (getattr(tokenizer, "eos_token_id", None), cfg):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, int) and not isinstance(v, bool):
                ids.add(int(v))
    return frozenset(ids)


def compress_context(session, context_ids: torch.Tensor, snapshot=None, chunk_size: int | None = None) -> ResidentBytes:
    """Compress ``context_ids`` [1, T] with the active ``session``'s plan, restored from the prefill
    ``snapshot`` when given (:func:`polykv.runtime.fork.capture_prefill`), else prefilled; returns the resident
    bytes of the compressed context (before anything else is fed)."""
    if snapshot is not None:
        restore_prefill(session, snapshot)
    else:
        # Only the cache matters here: skip the vocabulary projection of every context position
        # (2048 x 262,144 logits on Gemma 3) where the model allows it.
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(session.model).forward).parameters \
            else {}
        session.prefill(context_ids, chunk_size=chunk_size, **keep)
    return session.resident_bytes()


def generate_answer(session, question_ids: torch.Tensor, max_new_tokens: int, stop: frozenset[int],
                    done: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Feed ``question_ids`` [1, q] through the session's compressed cache in one forward, then generate greedily
    (one decode forward per token) until a token of ``stop``, ``max_new_tokens``, or ``done(tokens so far)``
    (a stop sequence, say); the generated ids."""
    out, tokens = forward(session, question_ids), []
    for _ in range(max_new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)                       # (1, 1)
        tokens.append(int(nxt))
        if tokens[-1] in stop or len(tokens) == max_new_tokens or (done is not None and done(tokens)):
            break
        out = forward(session, nxt)
    return tokens


@attrs.define(frozen=True)
class AnswerRun:
    """One question answered from a compressed context, in token ids."""

    tokens: list[int]
    """The generated ids (the stop token included when one ended the answer)."""
    context_bytes: ResidentBytes
    """Resident bytes of the compressed context, before the question was fed."""
    end_bytes: ResidentBytes
    """Resident bytes after the last generated token."""


def answer_from_context(session, context_ids: torch.Tensor, question_ids: torch.Tensor, *, max_new_tokens: int,
                        stop: frozenset[int], snapshot=None, chunk_size: int | None = None,
                        done: Callable[[list[int]], bool] | None = None) -> AnswerRun:
    """The protocol for one question inside the active ``session``: :func:`compress_context`, then
    :func:`generate_answer`."""
    kv = compress_context(session, context_ids, snapshot, chunk_size)
    tokens = generate_answer(session, question_ids, max_new_tokens, stop, done)
    return AnswerRun(tokens=tokens, context_bytes=kv, end_bytes=session.resident_bytes())


@attrs.define(frozen=True)
class Answers:
    """What :func:`answer` returns: per question, the answer text and ids, and the measured bytes."""

    texts: list[str]
    """The decoded answers (special tokens skipped), in question order."""
    tokens: list[list[int]]
    """The generated ids per question."""
    context_tokens: int
    """Tokens of the context part (the chat template's opening included)."""
    question_tokens: list[int]
    """Tokens fed after the context, per question."""
    context_bytes: ResidentBytes
    """Resident bytes of the compressed context (the same for every question)."""
    end_bytes: list[ResidentBytes]
    """Resident bytes at the end of each answer."""


def answer(model, plan: Plan, tokenizer, *, context: str, questions: str | Sequence[str], max_new_tokens: int = 64,
           prompt_format: str = "plain", bos: Any = "auto", chunk_size: int | None = None,
           storage_dtype: torch.dtype | None = None, model_data: Mapping[str, Any] | None = None,
           registry=None, seed: int = 0) -> Answers:
    """Compress ``context`` once under ``plan``, then answer each of ``questions`` from the compressed cache.

    Parameters
    ----------
    model, tokenizer
        A transformers decoder the runtime serves (see :func:`polykv.apply`) and its tokenizer object.
    plan : Plan
        The plan the context is compressed with and the answers are generated under.
    context : str
        The text compressed before any question is seen.
    questions : str or sequence of str
        One question, or several; each is answered from the same compressed context.
    max_new_tokens : int
        Most tokens generated per answer (greedy; the tokenizer's and the model's EOS ids end one earlier).
    prompt_format, bos
        The prompt rule (:mod:`polykv.runtime.prompt`): ``"plain"`` or ``"chat"`` (the chat template, split
        after the context); ``bos`` ``"auto"``, True or False.
    chunk_size, storage_dtype, model_data, registry, seed
        As :meth:`polykv.runtime.Session.prefill` and :func:`polykv.apply` take them.

    Raises
    ------
    RuntimeConfigError
        Bad arguments (no question, an empty context, a non-positive ``max_new_tokens``), a prompt rule the
        tokenizer cannot follow, or anything :func:`polykv.apply` refuses.
    """
    single = isinstance(questions, str)
    asked = [questions] if single else list(questions) if isinstance(questions, (list, tuple)) else None
    if not asked or not all(isinstance(q, str) and q for q in asked):
        raise RuntimeConfigError(f"answer(questions=...) needs a non-empty question string or a non-empty list of "
                                 f"them, got {questions!r}")
    if not isinstance(context, str) or not context:
        raise RuntimeConfigError(f"answer(context=...) needs the non-empty text to compress, got {context!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RuntimeConfigError(f"answer(max_new_tokens=...) must be a positive whole number of tokens, got "
                                 f"{max_new_tokens!r}")
    if not isinstance(plan, Plan):
        raise RuntimeConfigError(f"answer(model, plan, ...) needs a polykv Plan, got a {type(plan).__name__}; load a "
                                 f"plan file with polykv.load_plan(path) or build one with polykv.uniform_plan(...)")
    if tokenizer is None or isinstance(tokenizer, (str, bytes, os.PathLike)) \
            or not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise RuntimeConfigError(f"answer(model, plan, tokenizer) needs the model's tokenizer object (with encode and "
                                 f"decode), got the {type(tokenizer).__name__} {tokenizer!r}; load it first, e.g. "
                                 f"transformers.AutoTokenizer.from_pretrained(folder)")
    check_chunk_size(chunk_size, "answer")
    registry = registry or get_registry()
    encoder = PromptEncoder(tokenizer, bos=bos, prompt_format=prompt_format, where="answer()")
    device = next(model.parameters()).device
    parts = [encoder.prompt_ids(context, q) for q in asked]
    if any(ctx != parts[0][0] for ctx, _ in parts):
        raise RuntimeConfigError("answer(): the chat template renders the context differently for different "
                                 "questions, so one compressed context cannot serve them all; ask them one at a time")
    ctx = torch.tensor([parts[0][0]], dtype=torch.long, device=device)
    plan = fill_tokenizer_params(plan, registry, model, tokenizer)
    stop = stop_ids(model, tokenizer)
    session = apply(model, plan, model_data=model_data, registry=registry, storage_dtype=storage_dtype, seed=seed)
    with torch.no_grad():                                   # (checked before the model runs over the context)
        snapshot = capture_prefill(model, ctx, [plan], registry=registry, chunk_size=chunk_size,
                                   model_data=session.model_data) if len(asked) > 1 else None
        runs = []
        with session:
            for _, q_ids in parts:
                question = torch.tensor([q_ids], dtype=torch.long, device=device)
                runs.append(answer_from_context(session, ctx, question, max_new_tokens=max_new_tokens, stop=stop,
                                                snapshot=snapshot, chunk_size=chunk_size))
    return Answers(texts=[tokenizer.decode(r.tokens, skip_special_tokens=True) for r in runs],
                   tokens=[r.tokens for r in runs], context_tokens=int(ctx.shape[1]),
                   question_tokens=[len(q) for _, q in parts], context_bytes=runs[0].context_bytes,
                   end_bytes=[r.end_bytes for r in runs])
