"""The plan-driven KV cache: a transformers ``Cache`` holding one
:class:`~polykv.runtime.layer_cache.LayerCache` per decoder layer, and the allocation runs of the plan's
layer groups. Create it with ``session.new_cache()``; the flow of a forward through one layer is in
:mod:`polykv.runtime.layer_cache`: ``update`` (the model's call) returns the keys and values attention reads,
carrying the layer's :class:`~polykv.runtime.layer_spec.ForwardStep` to it.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
from transformers.cache_utils import Cache

from polykv.errors import RuntimeConfigError
from polykv.runtime.allocation import GroupRun
from polykv.runtime.layer_cache import LayerCache
from polykv.runtime.layer_parts import probe_step
from polykv.runtime.layer_spec import CacheSettings, LayerSpec


LEGACY_CACHE_KEYWORD = "past_key_values"
"""The cache keyword of transformers before 5.x, deprecated where ``cache`` exists."""


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` where the installed transformers has it,
    else :data:`LEGACY_CACHE_KEYWORD`."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else LEGACY_CACHE_KEYWORD


def given_cache(kwargs: Mapping[str, Any], keyword: str):
    """The cache a caller handed a forward or ``generate`` in ``kwargs``: under ``keyword`` (the model's,
    :func:`cache_keyword`), else under :data:`LEGACY_CACHE_KEYWORD` (callers written for older transformers,
    and ``generate``'s own loop where it still uses that name); None when there is none."""
    return kwargs.get(keyword, kwargs.get(LEGACY_CACHE_KEYWORD))


def output_cache(output):
    """The cache a model output returns: ``output.cache`` where transformers names it so, else
    ``output.past_key_values``."""
    return output["cache"] if "cache" in output else output.past_key_values


class PlanCache(Cache):
    """A transformers ``Cache`` whose layers follow a plan; create it with ``session.new_cache()``."""

    def __init__(self, *, specs: list[LayerSpec], settings: CacheSettings, groups: tuple = ()):
        self.settings = settings
        """What every layer reads from the session (one object, shared by the layers)."""
        self.prefill_continues = False
        """True between the chunks of a chunked prefill (selection waits for the last chunk)."""
        self.probe = None
        """The :class:`~polykv.contract.probe.ProbeChunk` whose forward runs now (None: a prompt or decode
        forward); set by the session around each probe forward."""
        self.prompt_ids: torch.Tensor | None = None
        """[B, T] the prompt's token ids so far, while a plan with a probe prefills (the probe is built from them)."""
        self.probe_tokens = 0
        """Extra forward tokens per batch row the probe ran (0: no probe)."""
        self.runs = [GroupRun(group, allocator) for group, allocator in groups]
        run_of = {layer: run for run in self.runs for layer in run.group.layers}
        layers: list[LayerCache] = []
        for s in specs:  # a shared pair's upper layer merges with its lower layer's stored prompt
            lower = layers[s.plan.share] if s.plan.share is not None else None
            layers.append(LayerCache(layer_idx=s.plan.layer, spec=s, settings=settings,
                                     group=run_of.get(s.plan.layer), lower=lower))
        super().__init__(layers=layers)

    def group_run(self, layer_idx: int):
        """The allocation run of the group ``layer_idx`` belongs to, or None."""
        return self.layers[layer_idx].group

    def allocations(self) -> dict[int, dict[str, Any]]:
        """Per allocated layer: ``budget`` (tokens per head: an int, or a list per KV head) and
        ``stored`` (tokens each batch row and KV head held right after prefill)."""
        out = {}
        for run in self.runs:
            out.update(run.report)
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The model's call after RoPE: the layer begins its forward and returns what attention reads."""
        return self.layers[layer_idx].update(key_states, value_states, ends_prompt=not self.prefill_continues,
                                             probe=self.probe)

    def begin(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """:meth:`update` without the model: the layer's :class:`~polykv.runtime.layer_cache.ForwardStep`,
        to hand to ``layers[layer_idx].after_attention``."""
        if self.probe is not None:
            return probe_step(self.layers[layer_idx], key_states, value_states, self.probe)
        return self.layers[layer_idx].begin(key_states, value_states, ends_prompt=not self.prefill_continues)

    def end_probe(self, chunks) -> None:
        """The probe's ``chunks`` have run (the prompt's forwards held every layer's selection): every layer
        selects and stores its prompt now, in layer order (allocation groups included)."""
        self.probe = None
        self.prompt_ids = None
        self.probe_tokens = sum(c.num_tokens for c in chunks)
        for layer in self.layers:
            if not layer.prefilled:
                layer.end_prefill()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (drives new position ids), not tokens stored."""
        return self.layers[layer_idx].tokens_seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].num_stored()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def stored_tokens(self) -> list[int]:
        """Tokens stored per layer (the longest head of a ragged layer)."""
        return [layer.num_stored() for layer in self.layers]

    def head_counts(self) -> list[list[list[int]]]:
        """Tokens stored per layer, batch row and KV head."""
        return [layer.head_counts().tolist() for layer in self.layers]

    def _unsupported(self, what: str):
        raise RuntimeConfigError(f"{what} is not supported by the polykv cache (its layers hold different tokens); "
                                 f"use greedy or sampled decoding with one sequence per batch row")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted or speculative decoding)")

    def batch_select_indices(self, indices: torch.Tensor):
        self._unsupported("selecting batch rows")

    def batch_repeat_interleave(self, repeats: int):
        if any(layer.tokens_seen for layer in self.layers):
            self._unsupported("repeating a filled cache's batch rows")
