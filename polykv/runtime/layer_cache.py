"""The cache of one decoder layer under a plan (:class:`LayerCache`), built from a
:class:`~polykv.runtime.layer_spec.LayerSpec`, and its forward's step in attention (:func:`serve`);
:class:`~polykv.runtime.cache.PlanCache` holds one layer per decoder layer inside a transformers ``Cache``.

Each layer holds a :class:`~polykv.runtime.storage.LayerStorage` (key and value stores and the original
position of every stored token, uniform or ragged across KV heads) and its rules at work: the rule objects of its
spec, their states (:attr:`LayerCache.states`) and the extra states that observe the same forwards (an
allocator's, a prefill capture's). A selection runs the phase's rule on a view of the layer's tokens through a
:class:`~polykv.contract.rules.SelectionContext` (:meth:`LayerCache.context`), is checked
(:func:`~polykv.contract.selection.checked_selection`), and every observing state gathers with it, so the
states keep following the kept tokens.

A forward runs in two halves joined by one :class:`~polykv.runtime.layer_spec.ForwardStep`:
:meth:`LayerCache.update` (the model's call, right after RoPE) begins it (:meth:`LayerCache.begin`) and returns
the keys and values attention reads, carrying the step (:func:`polykv.attention.attach.hand_over`); transformers'
attention call reaches :func:`serve` with the layer and step as explicit arguments, which refuses what the runtime
cannot serve, attends as the step says (:func:`polykv.attention.attach.attend`) and hands the step back to
:meth:`LayerCache.after_attention`: every state observes the forward, then the layer selects and stores (prefill)
or evicts (decode).

Prefill (the first forward on an empty cache, or every chunk of a chunked prefill): attention runs on the raw
prompt K/V (:attr:`LayerCache.prompt`); once the prompt is complete (:meth:`LayerCache.end_prefill`) a windowed
layer keeps each head's newest tokens within its bound, the prefill rule selects (merging in full precision when
its selection says so) and only the survivors are stored (quantization happens after eviction and merging). A
layer in an allocation group waits for its allocator (:mod:`polykv.runtime.allocation`), which calls the same
two steps. Decode (every later forward): append to the stores, attend, then (:meth:`LayerCache.evict`) a windowed
layer drops what falls out of its bound, and once some head stores more than its capacity + ``decode_slack`` the
decode rule selects and the storage evicts. The optional parts (a window bound, a shared pair, low-rank codes, a
probe forward) are picked from the plan layer when the layer is built (:mod:`polykv.runtime.layer_parts`); a
layer without them runs none of their code.

Shapes: B batch, H query heads, Hkv KV heads, T stored tokens, q new tokens, d head dim.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import CacheLayerMixin

from polykv.attention.attach import attend, hand_over
from polykv.contract.rules import SelectionContext
from polykv.contract.selection import Selection, checked_selection
from polykv.contract.state import AccumulatedAttention, Observation, QueryWindow, state_bytes
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import SLIDING
from polykv.runtime.layer_parts import SharedPrompt, WindowBound, probe_step, reads_stores
from polykv.runtime.layer_spec import CacheSettings, ForwardStep, LayerSpec
from polykv.runtime.probe_pass import probe_attention
from polykv.runtime.ragged import over_budget
from polykv.runtime.storage import LayerStorage, StorageView, joined, new_store
from polykv.storage.token_buffer import layer_hold, reserve_tokens


class LayerCache(CacheLayerMixin):
    """Cache of one decoder layer under a plan (see the module docstring for the flow)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, *, layer_idx: int, spec: LayerSpec, settings: CacheSettings, group=None, lower=None):
        super().__init__()
        self.layer_idx, self.spec, self.settings = layer_idx, spec, settings
        self.group = group
        """The :class:`~polykv.runtime.allocation.GroupRun` of the allocation group this layer belongs to, or None."""
        self.tokens_seen = 0
        """Tokens processed (= position of the next token), whatever was evicted."""
        self.prefilled = False
        contract = None  # a 16-bit layer's stores are polykv's own buffers: checked only with the expensive checks
        if settings.check or spec.quantizer is not None:
            contract = spec.store_contract(storage_dtype=settings.storage_dtype, full=settings.check)
        self.storage = LayerStorage(self._new_store, self.reserve_for, contract=contract,
                                    exact_growth=spec.decode_rule is not None or spec.token_bound is not None)
        self.states = new_states(spec)
        """``{"prefill": RuleState | None, "decode": RuleState | None}`` of the layer's rules (one object when
        shared)."""
        self.extra_states: list = []
        """States observing this layer besides its rules' (an allocator's, a prefill capture's)."""
        if group is not None:
            state = group.join(self)
            if state is not None:
                self.extra_states.append(state)
        self.window = WindowBound(spec.token_bound) if spec.token_bound is not None else None
        self.share = SharedPrompt(lower, spec.plan.share_params) if lower is not None else None
        self.budget: int | torch.Tensor | None = None
        """Capacity an allocator gave this layer: tokens per head, or [Hkv] per head; None = the plan's."""
        self.scaling: float | None = None
        self.prompt: StorageView | None = None
        """The prompt's keys, values and positions while prefill runs, unstored (after the prefill rule ran:
        its selection); None once :meth:`store_prompt` moved it into the stores."""
        self.read_stores = True
        """Decode forwards attend straight from the stores when they can (:func:`~polykv.runtime.layer_parts.reads_stores`); False:
        build the dense view (dequantized, ragged heads padded) and run SDPA (the comparison path)."""
        self.low_rank = None
        """The spec's bases on the cache's device and dtype (set with the first forward), or None."""
        self.attended = True
        """False from an ``update`` until attention finished its step: a check that the model's attention ran
        through polykv (the step itself travels with the keys ``update`` returns)."""

    # -- the layer's rules at work ---------------------------------------------------------------
    def observing_states(self) -> list:
        """Every distinct state that observes this layer's forwards."""
        out = []
        for st in [self.states["prefill"], self.states["decode"], *self.extra_states]:
            if st is not None and all(st is not o for o in out):
                out.append(st)
        return out

    def gather_states(self, sel: Selection) -> None:
        """Every observing state follows ``sel`` (the kept tokens)."""
        for st in self.observing_states():
            st.gather(sel)

    def context(self, phase: str, view: StorageView, state, *, values: bool, head_capacity=None) -> SelectionContext:
        """The SelectionContext of ``view``: ``state`` as ``ctx.state``, and the built-in helpers it
        contains as ``queries``/``query_positions`` and ``accumulated``/``query_counts``."""
        settings = self.settings
        window = state.component(QueryWindow) if state is not None else None
        acc = state.component(AccumulatedAttention) if state is not None else None
        return SelectionContext(
            layer_idx=self.layer_idx, phase=phase, keys=view.keys, positions=view.positions,
            tokens_seen=self.tokens_seen, scaling=self.scaling,
            queries=window.queries if window is not None else None,
            query_positions=window.positions if window is not None else None,
            values=view.values if values else None,
            accumulated=acc.sums if acc is not None else None,
            query_counts=acc.query_counts(view.positions) if acc is not None else None,
            rope_inv_freq=settings.rope_inv_freq, rope_scaling=settings.rope_scaling, model_data=settings.model_data,
            generator=settings.generator, state=state, valid=view.valid, head_capacity=head_capacity,
            checks=settings.check)

    def select(self, phase: str, capacity: int, view: StorageView,
               head_capacity: torch.Tensor | None = None) -> Selection:
        """Run the ``phase`` rule on ``view``; check its selection; gather every observing state; return it."""
        rule = self.spec.prefill_rule if phase == "prefill" else self.spec.decode_rule
        B, Hkv, _ = view.positions.shape
        ctx = self.context(phase, view, self.states[phase], values=rule.needs_values,
                           head_capacity=None if head_capacity is None
                           else head_capacity.to(view.positions.device).expand(B, Hkv))
        op = getattr(self.spec.plan, phase)
        check = getattr(rule, "check_capacity", None)
        if check is not None and head_capacity is None:  # a capacity resolved from a ratio: known only now
            try:
                check(int(capacity))
            except ValueError as exc:
                ratio = "" if op.capacity_ratio is None else \
                    f" (capacity_ratio {op.capacity_ratio:g} of {self.tokens_seen} tokens)"
                raise RuntimeConfigError(f"layer {self.layer_idx} ({phase}): {exc}{ratio}") from None
        sel = checked_selection(rule.select(ctx, capacity), ctx, capacity,
                                where=f"layer {self.layer_idx} ({phase}): rule '{op.rule}'")
        self.gather_states(sel)
        return sel

    def capacity(self, phase: str) -> tuple[int | None, torch.Tensor | None]:
        """``(tokens per head, per-head capacities [Hkv] or None)`` the layer keeps in ``phase``: the budget an
        allocator gave it, else the plan's op at the tokens seen (None: everything)."""
        budget = self.budget
        if budget is None:
            return getattr(self.spec.plan, phase).resolve_capacity(self.tokens_seen), None
        if isinstance(budget, torch.Tensor):
            return int(budget.max()), budget
        return int(budget), None

    def reserve_for(self, kept: int, ragged: bool) -> int:
        """Token rows a head holding ``kept`` tokens reserves (the reserve policy of
        :mod:`polykv.storage.token_buffer`): the layer is cut back to ``capacity + decode_slack`` when its decode op
        evicts (a ragged head: its own ``kept + slack``), capped by a window's bound."""
        cap = None
        if self.spec.decode_rule is not None:
            cap = kept if ragged else self.capacity("decode")[0]
        slack = self.settings.decode_slack
        return reserve_tokens(kept, layer_hold(capacity=cap, decode_slack=slack, bound=self.spec.token_bound),
                              slack=slack)

    def _new_store(self, stream: str):
        return new_store(self.spec.quantizer, self.spec.plan, stream, dtype=self.dtype, device=self.device,
                         storage_dtype=self.settings.storage_dtype)

    # -- transformers layer interface ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        if self.spec.low_rank is not None:
            self.low_rank = self.spec.low_rank.to(self.device, self.dtype)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def num_stored(self) -> int:
        """Stored tokens of the longest head (the raw prompt during prefill)."""
        if self.prompt is not None:
            return int(self.prompt.positions.shape[-1])
        return 0 if self.storage.shape is None else self.storage.width()

    def head_counts(self) -> torch.Tensor:
        """[B, Hkv] int64 tokens stored per head."""
        if self.prompt is not None:
            B, H, T = self.prompt.positions.shape
            return torch.full((B, H), T) if self.prompt.valid is None else self.prompt.valid.sum(-1).cpu()
        return self.storage.counts()

    @property
    def positions(self) -> torch.Tensor | None:
        """[B, Hkv, T] int64 original positions of the stored tokens (-1 on ragged padding)."""
        if self.prompt is not None:
            return self.prompt.positions
        if self.storage.shape is None:
            return None
        return self.storage.positions if not self.storage.ragged else self.storage.view().positions

    @property
    def key_store(self):
        return self.storage.key_store

    @property
    def value_store(self):
        return self.storage.value_store

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers before get_query_offset (5.0-5.2) pass the new tokens' cache_position [q] instead
        q = query_length.shape[-1] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.num_stored() + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        """No fixed maximum (the name transformers 5.0-5.2 give :meth:`get_max_length`)."""
        return self.get_max_length()

    def reset(self) -> None:
        lower = self.share.lower if self.share is not None else None
        self.__init__(layer_idx=self.layer_idx, spec=self.spec, settings=self.settings, group=self.group, lower=lower)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, ends_prompt: bool = True,
               probe=None, **kwargs):
        """The transformers layer interface: :meth:`begin` a forward and return the keys and values it attends
        (a low-rank layer's codes), carrying the step to attention (:func:`serve`)."""
        step = probe_step(self, key_states, value_states, probe) if probe is not None \
            else self.begin(key_states, value_states, ends_prompt=ends_prompt)
        self.attended = False
        return hand_over(step.view.keys, step.view.values, functools.partial(serve, self, step))

    def begin(self, key_states: torch.Tensor, value_states: torch.Tensor, *, ends_prompt: bool = True) -> ForwardStep:
        """Take the q new post-RoPE keys/values [B, Hkv, q, d] of a forward; return its :class:`ForwardStep`.

        Prefill: they join the unstored prompt, which the step attends. Decode: they are appended to the stores,
        and the step attends the stores (:func:`~polykv.runtime.layer_parts.reads_stores`) or their dense view. ``ends_prompt``: whether
        the prompt is complete after this forward (False between the chunks of a chunked prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.low_rank is not None:  # codes P^T k, U^T v, projected as they arrive: nothing full width is stored
            key_states, value_states = self.low_rank.codes(key_states, value_states)
        B, Hkv, q, _ = key_states.shape
        have = self.prompt.positions.shape[0] if self.prompt is not None else (self.storage.shape or (B,))[0]
        if have != B:
            raise RuntimeConfigError(f"layer {self.layer_idx}: the cache holds a batch of {have} "
                                     f"but this forward has {B}; start a new cache with session.new_cache()")
        stores, states = None, tuple(self.observing_states())
        if not self.prefilled:
            self.prompt = view = joined(self.prompt, key_states, value_states, self.tokens_seen)
        else:
            self.storage.append(key_states, value_states, self.tokens_seen)
            if not states and reads_stores(self):  # attention reads the stores; no dense view is built
                stores = self.storage
                view = StorageView(keys=key_states, values=value_states, positions=None, valid=None)
            else:
                view = self.storage.view()
        spec = self.spec
        return ForwardStep(layer_idx=self.layer_idx, phase="decode" if self.prefilled else "prefill", view=view,
                           stores=stores, first_position=self.tokens_seen, states=states,
                           ends_prompt=ends_prompt, attention_type=spec.attention_type, window=spec.window)

    # -- after attention -------------------------------------------------------------------------
    def after_attention(self, step: ForwardStep, query: torch.Tensor, scaling: float, signals=None) -> None:
        """Finish ``step`` (from :meth:`begin`): let every state observe the q new queries [B, H, q, d] (on a
        low-rank layer as key codes [B, H, q, k_rank]), then select (prefill) or evict (decode).

        ``signals``: the :class:`~polykv.contract.state.AttentionSignals` the attention pass computed, if any."""
        self.attended = True
        view, states = step.view, step.states
        if states:
            if self.low_rank is not None:  # the states read queries as the stored keys are: key codes
                query = self.low_rank.queries(query)
            obs = Observation(
                layer_idx=self.layer_idx, phase=step.phase, query=query, keys=view.keys, positions=view.positions,
                valid=view.valid, first_position=step.first_position, scaling=scaling, signals=signals,
                rope_inv_freq=self.settings.rope_inv_freq, probe=step.probe, model_data=self.settings.model_data,
                attention_input=self.settings.attention_inputs.pop(self.layer_idx, None))
            for st in states:
                st.observe(obs)
        if step.probe is not None:  # the probe's keys and values go with its step; nothing is stored or counted
            return
        self.tokens_seen += query.shape[2]
        self.scaling = scaling
        if not self.prefilled:
            if step.ends_prompt:
                self.end_prefill()
        else:
            self.evict(step)
            for st in states:
                st.after_decode_step()

    # -- prefill: select and store ------------------------------------------------------------------
    def end_prefill(self) -> None:
        """The prompt is complete: select and store now, or hand the layer to its allocation group."""
        sel = self.window.newest(self.prompt) if self.window is not None else None
        if sel is not None:
            self.gather_states(sel)
            self.prompt = self.prompt.take(sel)
        if self.group is not None:
            self.group.layer_done(self)
            return
        self.select_prompt(self.capacity("prefill")[0])
        self.store_prompt()

    def select_prompt(self, capacity: int | None, head_capacity: torch.Tensor | None = None) -> None:
        """Run the prefill rule on the (raw or already selected) prompt when some head exceeds its budget."""
        raw = self.prompt
        if self.spec.prefill_rule is None or capacity is None:
            return
        if raw.valid is None and head_capacity is None:  # every head holds the prompt: plain ints
            if raw.positions.shape[-1] <= capacity:
                return
        else:
            counts = self.head_counts()
            if not over_budget(counts.sum(-1).tolist(), counts.shape[1], capacity, head_capacity, 0):
                return
        sel = self.select("prefill", capacity, raw, head_capacity)
        if sel.merge is not None:
            keys = sel.merge.apply(raw.keys)[0] if "key" in sel.merge.streams else raw.keys
            values = sel.merge.apply(raw.values)[0] if "value" in sel.merge.streams else raw.values
            raw = StorageView(keys=keys, values=values, positions=raw.positions, valid=raw.valid)
        self.prompt = raw.take(sel, sel.kept_mask() if sel.ragged else None)

    def store_prompt(self) -> None:
        """Move the (selected) prompt into the stores; only the decode rule's state stays."""
        raw = self.prompt
        counts = raw.valid.sum(-1) if raw.valid is not None else None
        self.storage.fill(raw.keys, raw.values, raw.positions, counts)
        if self.share is not None:
            self.share.merge(self.storage, held_dtype=self.settings.storage_dtype or self.dtype, compute_dtype=self.dtype)
        self.prompt = None
        dec = self.states["decode"]  # only the decode rule's state stays
        if dec is not None:
            dec.after_prefill()
        self.states, self.extra_states = {"prefill": None, "decode": dec}, []
        self.prefilled = True

    # -- decode: evict --------------------------------------------------------------------------------
    def evict(self, step: ForwardStep) -> None:
        """After a decode forward: drop what falls out of a window's bound, then run the decode rule once some
        head stores more than its capacity + ``decode_slack`` (a merge is written into the stores first)."""
        view = step.view
        if self.window is not None and self.storage.width() > self.window.bound:
            sel = self.window.newest(view)
            self.gather_states(sel)
            self.storage.evict(sel, view)
            view = self.storage.view()
        if self.spec.decode_rule is None:
            return
        cap, head_cap = self.capacity("decode")
        if cap is None or not self._stores_over(cap, head_cap):
            return
        if step.stores is not None:  # the stores were read: build the view to select
            view = self.storage.view()
        sel = self.select("decode", cap, view, head_cap)
        self.storage.evict(sel, view)

    def _stores_over(self, capacity: int, head_capacity: torch.Tensor | None) -> bool:
        slack = self.settings.decode_slack
        n = self.storage.uniform_count()
        if n is not None and head_capacity is None:
            return n > capacity + slack                      # the decode hot path: plain ints
        return over_budget(self.storage.row_totals(), self.storage.shape[1], capacity, head_capacity, slack)

    # -- accounting ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Key + value store bytes (codes, scales/zeros, full-precision residuals)."""
        return self.storage.kv_bytes()

    def bases_bytes(self) -> int:
        """Bytes of this layer's bases on the cache's device (0 for a full-width layer or before a forward)."""
        lr = self.low_rank
        return 0 if lr is None else sum(b.numel() * b.element_size() for b in (lr.key, lr.value) if b is not None)

    def metadata_bytes(self) -> dict[str, int]:
        """positions int64 (8 bytes per stored token per KV head) + rule-state bytes by ``metadata_name``
        (``accumulated``, ``query_window``, ``rule_state`` for any other state)."""
        out = {"positions": self.storage.positions_bytes(), **state_bytes(self.observing_states())}
        if self.share is not None and self.prefilled:
            out["share_index"] = self.storage.share_index_bytes()
        return out


def new_states(spec: LayerSpec) -> dict:
    """Fresh states of the layer's two rules; equal ``share_key`` -> one object serves both."""
    pre = spec.prefill_rule.new_state() if spec.prefill_rule is not None else None
    dec = spec.decode_rule.new_state() if spec.decode_rule is not None else None
    if pre is not None and dec is not None and pre.share_key is not None and pre.share_key == dec.share_key:
        dec = pre
    return {"prefill": pre, "decode": dec}


# -- the step in attention ------------------------------------------------------------------------------------

def serve(layer: LayerCache, step: ForwardStep, module, query, key, value, attention_mask, *, scaling: float,
          dropout: float = 0.0, **kwargs):
    """Attend ``step`` of ``layer`` (both from the layer's ``update``) for ``module``; ``query`` [B, H, q, d].
    Returns the output as transformers wants it, [B, q, H, d], and no attention weights."""
    layer_idx = step.layer_idx
    if attention_mask is not None:
        raise RuntimeConfigError(
            f"layer {layer_idx}: the attention function received a 4D attention mask (one passed by the caller, or "
            f"one the model builds itself); the polykv runtime builds its own masks and supports only unpadded "
            f"batches: pass no 4D mask (a model that builds its own masks cannot be served)")
    if kwargs.get("output_attentions"):
        raise RuntimeConfigError("output_attentions is not supported by the polykv runtime (attention runs in SDPA)")
    if dropout and module.training:
        raise RuntimeConfigError(f"layer {layer_idx}: the polykv runtime serves attention in eval mode; this model "
                                 f"asks for attention dropout in training mode (call model.eval())")
    if kwargs.get("sliding_window") is not None:  # the model's own window: only a windowed model passes one
        _check_window(step, layer_idx, kwargs["sliding_window"])
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if layer.spec.plain and (softcap is not None or sinks is not None):
        raise RuntimeConfigError(
            f"layer {layer_idx}: polykv.apply found no logit softcapping and no attention sinks on this attention "
            f"module, but its forward asks for them; the model's attention modules disagree with what they attend "
            f"with, so the polykv runtime cannot serve this model")
    if step.probe is not None and (own := probe_attention(step, layer.low_rank, softcap, sinks)) is not None:
        out, signals = own(query, key, value, scaling, step.probe, step.first_position), None  # the probe state's
    else:
        out, signals = attend(step, layer.low_rank, query, key, value, scaling, softcap, sinks)
    layer.after_attention(step, query, scaling, signals=signals)
    return out.transpose(1, 2).contiguous(), None


def _check_window(step, layer_idx, model_window) -> None:
    """The model's own ``sliding_window`` argument must agree with the layer's recorded attention type."""
    if step.attention_type == SLIDING and step.window == int(model_window):
        return
    raise RuntimeConfigError(
        f"layer {layer_idx}: the model attends with sliding window {model_window} but its geometry records "
        f"'{step.attention_type}' (window {step.window}); the config's layer_types/sliding_window disagree with "
        f"the attention modules, so the polykv runtime cannot serve this model")
