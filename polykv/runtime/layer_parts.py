"""The optional parts of a layer cache, picked from its plan layer when the cache is built, so a layer without
them runs none of their code: a window's token bound (:class:`WindowBound`), a shared layer pair's merge
(:class:`SharedPrompt`), a probe forward (:func:`probe_step`) and decode attention straight from the stores
(:func:`reads_stores`). Ragged heads live in
:class:`~polykv.runtime.ragged.RaggedHeads`, low-rank codes in :class:`~polykv.attention.low_rank.LowRank`,
allocation budgets in :mod:`polykv.runtime.allocation`.

Shapes: B batch, Hkv KV heads, T tokens, n probe tokens, d head dim.
"""

from __future__ import annotations

import torch

from polykv.contract.selection import Selection, ragged_top_k
from polykv.errors import RuntimeConfigError
from polykv.plan import PASSTHROUGH_BITS
from polykv.runtime.layer_spec import ForwardStep
from polykv.runtime.storage import LayerStorage, StorageView, joined


class WindowBound:
    """A windowed layer's own bound: each head keeps at most its ``bound`` newest tokens (``window - 1``; every
    older one is outside the window of every later query), whatever the plan says."""

    def __init__(self, bound: int):
        self.bound = bound

    def newest(self, view: StorageView) -> Selection | None:
        """The selection of each head's ``bound`` newest tokens of ``view``; None when it holds no more."""
        bound = self.bound
        if view.positions.shape[-1] <= bound:
            return None
        if view.valid is None:
            T = view.positions.shape[-1]
            index = torch.arange(T - bound, T, device=view.positions.device).expand(*view.positions.shape[:2], bound)
            return Selection(index=index.contiguous())
        scores = view.positions.masked_fill(~view.valid, -1).to(torch.float64)
        return ragged_top_k(scores, view.valid.sum(-1).clamp(max=bound))


class SharedPrompt:
    """The upper layer of a shared pair (the plan's ``share``, MiniCache): its stored prompt merges with the
    lower layer's (:meth:`~polykv.runtime.storage.LayerStorage.share_prompt`) right after it is stored."""

    def __init__(self, lower, params: dict):
        self.lower, self.params = lower, dict(params)
        """The lower layer's cache, and the plan's share parameters."""

    def merge(self, storage: LayerStorage, *, held_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        storage.share_prompt(self.lower.storage, held_dtype=held_dtype, compute_dtype=compute_dtype, **self.params)


def probe_step(layer, key_states: torch.Tensor, value_states: torch.Tensor, probe) -> ForwardStep:
    """A forward of a probe (:mod:`polykv.contract.probe`) through ``layer`` (a
    :class:`~polykv.runtime.layer_cache.LayerCache`): its n keys/values [B, Hkv, n, d] attend after the whole
    unselected prompt (:func:`~polykv.runtime.storage.joined`), unstored; only the states that declare ``observes_probe`` observe it."""
    raw = layer.prompt
    if layer.prefilled or raw is None:
        raise RuntimeConfigError(f"layer {layer.layer_idx}: a probe forward runs only between the prompt and its "
                                 f"selection, but this layer holds no unselected prompt")
    if layer.low_rank is not None:
        key_states, value_states = layer.low_rank.codes(key_states, value_states)
    B = key_states.shape[0]
    if raw.positions.shape[0] != B:
        raise RuntimeConfigError(f"layer {layer.layer_idx}: the probe has a batch of {B} but the prompt "
                                 f"{raw.positions.shape[0]}; build one probe row per prompt row")
    states = tuple(st for st in layer.observing_states() if getattr(st, "observes_probe", False))
    return ForwardStep(layer_idx=layer.layer_idx, phase="probe",
                       view=joined(raw, key_states, value_states, layer.tokens_seen), stores=None,
                       first_position=layer.tokens_seen, states=states, ends_prompt=False,
                       attention_type=layer.spec.attention_type, window=layer.spec.window, probe=probe)


def reads_stores(layer) -> bool:
    """Whether a decode forward of ``layer`` (a :class:`~polykv.runtime.layer_cache.LayerCache`) attends straight
    from the stores (:func:`polykv.attention.online_softmax.decode_attention_from_stores`, per head for a ragged layer) instead
    of the dense view: a full-attention layer with plain softmax attention whose stores read in token
    blocks, no rule state observing every forward (states read the dense keys), and something the view
    would cost: a quantized stream (dequantizing the whole layer) or ragged heads (padding them to
    the longest). A uniform 16-bit layer's view is its buffers, so it keeps SDPA over them. An
    eviction still builds the view, in the forwards where it fires."""
    plan, st = layer.spec.plan, layer.storage
    if not (layer.read_stores and layer.spec.plain and layer.spec.window is None):
        return False
    if not st.ragged and plan.k_bits == PASSTHROUGH_BITS and plan.v_bits == PASSTHROUGH_BITS:
        return False
    pair = (st.segments[0].key, st.segments[0].value) if st.ragged else (st.key_store, st.value_store)
    if not all(callable(getattr(x, "token_blocks", None)) for x in pair):  # every store is built alike
        return False
    return not layer.observing_states()
