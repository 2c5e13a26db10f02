"""The probe of a session's plan: a model pass after the prompt, before any layer selects.

A rule that declares a probe (:mod:`polykv.contract.probe`) gets, after the prompt's last forward, the forwards
its probe chunks build from the prompt's token ids, attended against the whole unselected prompt; the states
that observe probes record what they need, the chunks' own keys and values are discarded, and only then does
every layer select. :class:`ProbePass` builds and checks the chunks (:meth:`ProbePass.chunks_for`), runs the
prompt forward of a plan with a probe (:meth:`ProbePass.prompt_forward`) and the chunks themselves
(:func:`run_probe_chunks`, which prefill snapshots call too).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from polykv.contract.probe import same_probe
from polykv.errors import RuntimeConfigError


class ProbePass:
    """The probe of one session's plan: the layers whose prefill rule runs one, and how to run it."""

    def __init__(self, model, geometry, layers: list[tuple[int, Any]], cache_keyword: str):
        self.model, self.geometry, self.cache_keyword = model, geometry, cache_keyword
        self.layers = list(layers)
        """(layer, prefill rule) of every layer whose rule runs a probe after the prompt."""

    def chunks_for(self, prompt_ids) -> list:
        """The probe the plan's rules build from ``prompt_ids`` [B, T] (one list of
        :class:`~polykv.contract.probe.ProbeChunk` for every probe rule of the plan), checked: every rule builds
        the same forwards, of token ids the model has, that fit its positions after the prompt."""
        if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.dtype.is_floating_point:
            layer, rule = self.layers[0]
            raise RuntimeConfigError(f"layer {layer}: rule '{rule.name}' runs a probe built from the prompt's token ids, "
                                     f"but this forward has no input_ids tensor [batch, tokens] (inputs_embeds?); pass "
                                     f"input_ids")
        T = int(prompt_ids.shape[1])
        first = None
        for layer, rule in self.layers:
            where = f"layer {layer}: rule '{rule.name}'"
            try:
                chunks = list(rule.probe_chunks(prompt_ids) or [])
            except ValueError as exc:
                raise RuntimeConfigError(f"{where}: cannot build its probe: {exc}") from None
            if first is None:
                first = (layer, rule, chunks)
            elif not same_probe(first[2], chunks):
                raise RuntimeConfigError(
                    f"{where} builds another probe than layer {first[0]} (rule '{first[1].name}'): one probe pass "
                    f"serves every layer, so every probe rule of a plan must use the same probe parameters")
        layer, rule, chunks = first
        where = f"layer {layer}: rule '{rule.name}'"
        vocab = getattr(self.model.config, "vocab_size", None)
        for c in chunks:
            ids = c.ids
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != prompt_ids.shape[0] \
                    or ids.shape[1] < 1 or ids.dtype.is_floating_point:
                raise RuntimeConfigError(f"{where}: probe chunk {c.index} must hold token ids [{prompt_ids.shape[0]}, n>=1], "
                                         f"got {getattr(ids, 'shape', type(ids).__name__)}")
            if vocab is not None and bool(((ids < 0) | (ids >= int(vocab))).any()):
                raise RuntimeConfigError(f"{where}: probe chunk {c.index} holds token ids outside the model's vocabulary "
                                         f"[0, {int(vocab)}); the rule's token-id parameters were made for another "
                                         f"tokenizer")
        limit = self.geometry.max_positions
        longest = max((c.num_tokens for c in chunks), default=0)
        if limit is not None and T + longest > int(limit):
            raise RuntimeConfigError(
                f"{where}: its probe runs up to {longest} tokens after the {T}-token prompt, {T + longest} positions, "
                f"more than the model's {int(limit)} (max_position_embeddings); shorten the prompt or lower the rule's "
                f"chunk size")
        return chunks

    def prompt_forward(self, forward, cache, args, kwargs):
        """A prompt forward of a plan with a probe: the prompt's last forward holds every layer's selection, the
        probe runs, then every layer selects (:mod:`polykv.contract.probe`)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            self.chunks_for(ids)  # raises: no token ids
        cache.prompt_ids = ids if cache.prompt_ids is None else torch.cat([cache.prompt_ids, ids], dim=1)
        if cache.prefill_continues:
            return forward(*args, **kwargs)
        chunks = self.chunks_for(cache.prompt_ids)
        cache.prefill_continues = True
        try:
            out = forward(*args, **kwargs)
        finally:
            cache.prefill_continues = False
        self.run_chunks(forward, cache, chunks, ids.device)
        cache.end_probe(chunks)
        return out

    def run_chunks(self, forward, cache, chunks, device) -> None:
        """:func:`run_probe_chunks` with this session's model and cache keyword."""
        run_probe_chunks(self.model, forward, cache, chunks, device, self.cache_keyword)


def run_probe_chunks(model, forward, cache, chunks, device, cache_keyword: str) -> None:
    """Run each probe chunk once through ``forward`` (``model``'s forward) against ``cache``, which attends them to
    the held prompt and stores nothing of them; only the last position's logits are computed."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
    try:
        with torch.no_grad():  # the forwards' outputs are dropped: only the states' records of them remain
            for chunk in chunks:
                cache.probe = chunk
                forward(chunk.ids.to(device), use_cache=True, **{cache_keyword: cache}, **keep)
    finally:
        cache.probe = None


def probe_attention(step, low_rank, softcap, sinks):
    """The ``attend_probe`` of the first state of a probe ``step`` that computes the probe's attention itself
    (:mod:`polykv.contract.probe`), or None: only on full-attention layers with plain softmax, full-width keys
    and no padding (elsewhere the runtime attends and the states observe)."""
    if step.probe is None or low_rank is not None or step.window is not None or softcap is not None \
            or sinks is not None or step.valid is not None:
        return None
    for state in step.states:
        for leaf in state.leaves():
            attend = getattr(leaf, "attend_probe", None)
            if callable(attend):
                return attend
    return None
