"""The one attach point of polykv's attention: :func:`attached` swaps a model's attention for the function
registered under :data:`NAME`, and each layer's cache ``update`` hands that function what to do with its keys.

transformers 5.x calls ``fn(module, query, key, value, attention_mask, scaling=..., **kw)`` right after the
layer's cache ``update``, with the ``key``/``value`` that ``update`` returned, and passes no cache (measured on
5.24: the keyword arguments are ``dropout``, ``scaling``, ``position_ids``, ``use_cache``, ``sliding_window``,
``softcap``, ``s_aux`` and router flags; some families, e.g. StableLM, pass none of the model call's keyword
arguments on). So the hand-off rides on the tensors themselves: a polykv cache layer's ``update`` returns its
keys as :class:`HandedKeys` (no copy; :func:`hand_over`) carrying an *attend* callable, and
:func:`polykv_attention` calls it::

    attend(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs) -> output [B, q, H, d]

with ``key`` a plain tensor again. Keys the model changed between the update and attention (an
operation on handed keys gives handed keys without ``attend``) are refused in one line: what the cache stores
would not be what attention reads. The runtime's session (its plan cache's layers), the masked reference
(:mod:`polykv.models.reference`) and calibration capture (:mod:`polykv.profiling.capture`) all attach through
here, the last two with a :class:`HandOverCache` that stores nothing; nothing is looked up on the module and
nothing global names a session. The model-wide mask is never built (:func:`no_mask`): each attend builds its own
per layer.

:func:`attend` is what a runtime layer's step does in attention once its refusals passed: the keys it holds (the
prompt, the dense view, or straight from the stores), through SDPA, the eager path or the one-pass signal kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from polykv.attention.kernels import eager_attention, sdpa, window_visibility
from polykv.attention.signals import AttentionSignals, attention_with_signals, signal_request
from polykv.errors import RuntimeConfigError

NAME = "polykv"
"""The attention implementation name a model carries while :func:`attached`."""


class HandedKeys(torch.Tensor):
    """Keys a cache layer's ``update`` returned, carrying what attention does with them (``attend``).
    An operation on them gives a :class:`HandedKeys` without it, so a changed tensor is told from the handed one
    and from one no polykv cache handed over."""

    attend: Callable | None = None


def _plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a plain tensor (the same storage)."""
    with torch._C.DisableTorchFunctionSubclass():
        return x.as_subclass(torch.Tensor)


def hand_over(keys: torch.Tensor, values: torch.Tensor, attend: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` (the same storage, no copy) carrying ``attend`` to :func:`polykv_attention`, and ``values``.
    Only the keys carry it: one small object per layer and forward."""
    handed = keys.as_subclass(HandedKeys)
    handed.attend = attend
    return handed, values


def _attend_of(x) -> Callable | None:
    return x.attend if isinstance(x, HandedKeys) else None


def polykv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: call what the layer's ``update`` handed over with its keys."""
    attend = _attend_of(key)
    if attend is None and isinstance(key, HandedKeys):  # an operation on the handed keys made these
        config = getattr(module, "config", None)
        kind = getattr(config, "model_type", None) or type(module).__name__
        raise RuntimeConfigError(
            f"model type '{kind}', layer {getattr(module, 'layer_idx', None)}: the attention module changed the keys "
            f"between the cache update and attention, so what polykv stores is not what it attends; this model "
            f"cannot be served")
    if attend is None:
        raise RuntimeConfigError(
            f"layer {getattr(module, 'layer_idx', None)} attended keys that did not come from a polykv cache: call "
            f"the model inside 'with polykv.apply(model, plan) as session:' and pass cache=session.new_cache() "
            f"(then session.cache) with use_cache=True")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    return attend(module, query, _plain(key), value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def attend(step, low_rank, query, key, value, scaling: float, softcap=None, sinks=None):
    """The output [B, H, q, d] of ``query`` over what ``step`` (a layer cache's forward step) attends
    (``key``/``value`` are its keys; a low-rank layer's codes, attended in code space and lifted), and the signals
    its states read, if computed."""
    if low_rank is not None:  # codes: logits (P^T q) . c with the head dim's own scaling
        query = low_rank.queries(query)
    view = step.view
    visible = None if step.window is None else window_visibility(
        view.positions, step.first_position, query.shape[2], window=step.window, attention_type=step.attention_type,
        same_rows=step.phase == "prefill")
    signals = None
    if step.stores is not None:
        out = step.stores.attend(query, scaling)
    elif softcap is not None or sinks is not None:
        out = eager_attention(query, key, value, scaling, view.valid, visible=visible, softcap=softcap, sinks=sinks)
    elif visible is None:
        out, signals = attention_and_signals(step, query, key, value, scaling, view.valid)
    else:
        out = sdpa(query, key, value, scaling, view.valid, visible=visible)
    return (out if low_rank is None else low_rank.lift(out)), signals


def attention_and_signals(step, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          valid: torch.Tensor | None) -> tuple[torch.Tensor, AttentionSignals | None]:
    """A forward (``step``) of a full-attention layer: the output [B, H, q, d] and the signals its states need.

    The states observing the step declare what they read (``RuleState.needs``).
    :func:`~polykv.attention.signals.attention_with_signals` computes the output and every declared
    signal in one pass when that saves work: in prefill when some state reads column sums (every
    query row contributes), and in every decode step whose states read anything (one query row: its
    probabilities are the attention's own). Otherwise plain SDPA and no signals: in prefill the newest
    rows alone cost ``r x K`` whenever they are computed, so states compute them when they select (a
    layer waiting for its allocation group holds no rows meanwhile), and the keep-everything plan
    stays vanilla.
    """
    request = signal_request(step.states)
    if request.needs_every_row or (request and step.phase == "decode"):
        return attention_with_signals(query, key, value, scaling, request, valid)
    return sdpa(query, key, value, scaling, valid), None


def no_mask(batch_size: int = 1, q_length: int = 1, kv_length: int = 1, q_offset: int = 0, kv_offset: int = 0,
            mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask interface: rejects padding, returns None (each attend builds its own per-layer masks)."""
    refuse_padding(attention_mask)
    return None


def refuse_padding(attention_mask: torch.Tensor | None) -> None:
    """One line for a 2D attention mask with padded positions (zeros); nothing for none or an all-ones mask."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise RuntimeConfigError(
            "the attention mask has padded positions (zeros): the polykv runtime supports batches of equal, "
            "unpadded lengths only, because per-head eviction would break the padding mask. Run sequences of "
            "different lengths one at a time (batch of 1) or group them by length")


def register() -> None:
    """Register the attention and mask functions with transformers under :data:`NAME` (idempotent)."""
    AttentionInterface.register(NAME, polykv_attention)
    AttentionMaskInterface.register(NAME, no_mask)


def attention_configs(model, modules=()) -> list:
    """The configs whose attention implementation :func:`attached` swaps: the model's and every module's."""
    found = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in (*model.modules(), *modules)]
             if c is not None and hasattr(c, "_attn_implementation_internal")}
    return list(found.values())


@contextlib.contextmanager
def attached(model, modules=()) -> Iterator[None]:
    """Within the block ``model`` attends through :func:`polykv_attention` (whatever its caches hand over);
    its attention implementation is restored on exit, whatever happens."""
    register()
    saved = [(c, c._attn_implementation_internal) for c in attention_configs(model, modules)]
    try:
        for c, _ in saved:
            c._attn_implementation_internal = NAME
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation_internal = impl


class AttentionInputs:
    """The hidden states entering the attention module of the layers whose states read them
    (:data:`~polykv.attention.signals.ATTENTION_INPUT`): a forward pre-hook on each such module keeps its input
    [B, q, D] in :attr:`held` until that layer's step pops it. A session owns one and hands :attr:`held` to its
    caches (``CacheSettings.attention_inputs``); each new cache hooks the layers whose states read the input
    (:meth:`hook_readers`), and the session's exit removes every hook (:meth:`unhook`). Layers whose states do not
    read it get no hook and their steps find nothing."""

    def __init__(self, modules):
        self.modules = dict(modules)
        """``layer index -> attention module`` of every layer that may be hooked."""
        self.held: dict[int, torch.Tensor] = {}
        """``layer index -> [B, q, D]`` input of the layer's current forward (popped by its step)."""
        self.handles: dict = {}
        """``layer index -> hook handle`` of the hooked layers."""

    def hook_readers(self, layers) -> None:
        """Hook, once, the attention module of each of ``layers`` (the runtime's layer caches: ``layer_idx`` and
        ``observing_states()``) whose states read the attention input."""
        for layer in layers:
            i = layer.layer_idx
            if i not in self.handles and signal_request(layer.observing_states()).attention_input:
                self.handles[i] = self.modules[i].register_forward_pre_hook(functools.partial(self._keep, i),
                                                                            with_kwargs=True)

    def unhook(self) -> None:
        """Remove every hook; nothing stays held."""
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
        self.held.clear()

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Within the block every module of :attr:`modules` keeps its input (a capture of every layer)."""
        for i, m in self.modules.items():
            self.handles.setdefault(i, m.register_forward_pre_hook(functools.partial(self._keep, i),
                                                                   with_kwargs=True))
        try:
            yield
        finally:
            self.unhook()

    def _keep(self, layer_idx: int, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise RuntimeConfigError(f"layer {layer_idx}: a rule of this layer reads the hidden states entering the "
                                     f"attention module, but {type(module).__name__} was called without a "
                                     f"[batch, tokens, hidden] 'hidden_states' input; this model cannot serve it")
        self.held[layer_idx] = hidden.detach()


class HandOverLayer(CacheLayerMixin):
    """A cache layer that stores nothing: ``update`` hands the keys and values over to ``attend`` as they are."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, attend: Callable):
        super().__init__()
        self.attend = attend

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return hand_over(key_states, value_states, self.attend)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        q = query_length.shape[-1] if isinstance(query_length, torch.Tensor) else int(query_length)
        return q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1


class HandOverCache(Cache):
    """A cache of ``num_layers`` :class:`HandOverLayer`: one cache-free forward whose every attention call is
    ``attend`` (pass it as the model's cache, with ``use_cache=True``)."""

    def __init__(self, num_layers: int, attend: Callable):
        super().__init__(layers=[HandOverLayer(attend) for _ in range(num_layers)])

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0
