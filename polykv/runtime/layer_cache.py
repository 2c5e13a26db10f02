"""The cache of one decoder layer under a plan (:class:`LayerCache`); :class:`~polykv.runtime.cache.PlanCache`
holds one per layer inside a transformers ``Cache``; what it is built from and what one forward carries are in
:mod:`polykv.runtime.layer_spec`.

Each layer holds a :class:`~polykv.runtime.storage.LayerStorage` (key and value stores and the
original position of every stored token, uniform or ragged across KV heads), its rule objects and
their states (:mod:`polykv.contract.state`). A forward runs in two halves joined by one
:class:`ForwardStep`: :meth:`LayerCache.begin` (reached through ``update``, which the model calls
right after RoPE) takes the new keys and values and returns the step, which says what this forward
attends (the prompt, the dense view of the stores, or the stores themselves), its padding and
positions, and which states observe it; the attention function (:mod:`polykv.runtime.attention`)
attends as the step says and hands it back to :meth:`LayerCache.after_attention`, which lets every
state observe the forward, then selects and stores (prefill) or evicts (decode). Between the two
halves the step is recorded in one place, :attr:`LayerCache.pending`.

Prefill (the first forward on an empty cache, or every chunk of :meth:`Session.prefill`): attention
runs on the raw prompt K/V (:attr:`LayerCache.prompt`); after the last chunk the prefill rule selects and
the survivors are stored. Decode (every later forward, one token or many): append to the stores, attend,
then evict with the decode rule once some head stores more than its capacity + ``decode_slack``. How a
layer selects, stores and evicts is :mod:`polykv.runtime.layer_selection`.

Shapes: B batch, H query heads, Hkv KV heads, T stored tokens, q new tokens, d head dim.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from polykv.runtime.plugin_results import StoreContract
from polykv.errors import RuntimeConfigError
from polykv.plan import PASSTHROUGH_BITS
from polykv.storage.reserve import layer_hold, reserve_tokens
from polykv.contract.state import Observation, state_bytes
from polykv.runtime.layer_selection import LayerSelection
from polykv.runtime.layer_spec import CacheSettings, ForwardStep, LayerSpec, new_rule_states
from polykv.runtime.storage import LayerStorage, StorageView, new_store


class LayerCache(LayerSelection, CacheLayerMixin):
    """Cache of one decoder layer under a plan (see the module docstring for the flow; selection and eviction:
    :class:`~polykv.runtime.layer_selection.LayerSelection`)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, *, layer_idx: int, spec: LayerSpec, settings: CacheSettings, group=None):
        super().__init__()
        self.layer_idx, self.spec, self.settings = layer_idx, spec, settings
        self.group = group
        """The :class:`~polykv.runtime.allocation.GroupRun` of the allocation group this layer belongs to, or None."""
        self.tokens_seen = 0
        """Tokens processed (= position of the next token), whatever was evicted."""
        self.prefilled = False
        self.storage = LayerStorage(self._new_store, self.reserve_for,
                                    exact_growth=spec.decode_rule is not None or spec.token_bound is not None,
                                    contract=StoreContract.for_plan_layer(layer_idx, spec.plan, settings.registry,
                                                                          storage_dtype=settings.storage_dtype,
                                                                          full=settings.check))
        self.states = new_rule_states(spec)
        """``{"prefill": RuleState | None, "decode": RuleState | None}`` (one object when shared)."""
        self.extra_states: list = []
        """More states observing this layer (an allocator's, a prefill capture's)."""
        if group is not None:
            state = group.join(self)
            if state is not None:
                self.extra_states.append(state)
        self.budget: int | torch.Tensor | None = None
        """Capacity an allocator gave this layer: tokens per head, or [Hkv] per head; None = the plan's."""
        self.scaling: float | None = None
        self.prompt: StorageView | None = None
        """The prompt's keys, values and positions while prefill runs, unstored (after the prefill rule ran:
        its selection); None once :meth:`store_prompt` moved it into the stores."""
        self.pending: ForwardStep | None = None
        """The step of the forward in progress, from :meth:`update` (the model's call) until the attention
        function hands it to :meth:`after_attention`; None between forwards."""
        self.read_stores = True
        """Decode forwards attend straight from the stores when they can (:meth:`reads_stores`); False:
        build the dense view (dequantized, ragged heads padded) and run SDPA (the comparison path)."""
        self.low_rank = None
        """The spec's bases on the cache's device and dtype (set with the first forward), or None."""
        self.plain_attention = True
        """Whether the model's attention here is a plain softmax (no logit softcap, no sinks), as the last
        :meth:`after_attention` was told; so it is known from the prefill forward on."""
        self.share_lower: LayerCache | None = None
        """The upper layer of a shared pair (the plan's ``share``): the lower layer's cache, whose stored prompt
        this layer's prompt merges with when it is stored (set by the :class:`~polykv.runtime.cache.PlanCache`)."""

    def hold_tokens(self, kept: int, ragged: bool) -> int | None:
        """Most tokens per head this layer keeps between forwards from now on (:func:`polykv.storage.reserve.layer_hold`):
        ``capacity + decode_slack`` when the decode op evicts (a ragged head: its own ``kept + slack``),
        capped by a window's bound; None when nothing cuts the layer back."""
        cap = None
        if self.spec.decode_rule is not None:
            if ragged:
                cap = kept
            elif self.budget is not None:
                cap = int(self.budget.max()) if isinstance(self.budget, torch.Tensor) else int(self.budget)
            else:
                cap = self.spec.plan.decode.resolve_capacity(self.tokens_seen)
        return layer_hold(capacity=cap, decode_slack=self.settings.decode_slack, bound=self.spec.token_bound)

    def reserve_for(self, kept: int, ragged: bool) -> int:
        """Token rows a head holding ``kept`` tokens reserves (:func:`polykv.storage.reserve.reserve_tokens`)."""
        return reserve_tokens(kept, self.hold_tokens(kept, ragged), slack=self.settings.decode_slack)

    def _new_store(self, stream: str):
        return new_store(self.settings.registry, self.spec.plan, stream, dtype=self.dtype, device=self.device,
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
        lower = self.share_lower
        self.__init__(layer_idx=self.layer_idx, spec=self.spec, settings=self.settings, group=self.group)
        self.share_lower = lower

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, ends_prompt: bool = True,
               probe=None, **kwargs):
        """The transformers layer interface: :meth:`begin` a forward, record its step in :attr:`pending` for the
        attention function, and return the keys and values it attends (a low-rank layer's codes)."""
        if probe is not None:
            step = self.pending = self.begin_probe(key_states, value_states, probe)
        else:
            step = self.pending = self.begin(key_states, value_states, ends_prompt=ends_prompt)
        return step.keys, step.values

    def begin_probe(self, key_states: torch.Tensor, value_states: torch.Tensor, probe) -> ForwardStep:
        """A forward of a probe (:mod:`polykv.contract.probe`): its n keys/values [B, Hkv, n, d] attend after the
        whole unselected prompt; the step's view joins them to the prompt without storing them, and only the
        states that declare ``observes_probe`` observe it."""
        raw = self.prompt
        if self.prefilled or raw is None:
            raise RuntimeConfigError(f"layer {self.layer_idx}: a probe forward runs only between the prompt and its "
                                     f"selection, but this layer holds no unselected prompt")
        key_states, value_states = self._codes(key_states, value_states)
        B, Hkv, n, _ = key_states.shape
        if raw.positions.shape[0] != B:
            raise RuntimeConfigError(f"layer {self.layer_idx}: the probe has a batch of {B} but the prompt "
                                     f"{raw.positions.shape[0]}; build one probe row per prompt row")
        pos = torch.arange(self.tokens_seen, self.tokens_seen + n, device=key_states.device).view(1, 1, n)
        view = StorageView(keys=torch.cat([raw.keys, key_states], dim=2),                     # (B, Hkv, T + n, d)
                           values=torch.cat([raw.values, value_states], dim=2),
                           positions=torch.cat([raw.positions, pos.expand(B, Hkv, n)], dim=-1), valid=None)
        states = tuple(st for st in self.observing_states() if getattr(st, "observes_probe", False))
        spec = self.spec
        return ForwardStep(layer_idx=self.layer_idx, phase="probe", view=view, stores=None,
                           first_position=self.tokens_seen, states=states, ends_prompt=False,
                           attention_type=spec.attention_type, window=spec.window, probe=probe)

    def begin(self, key_states: torch.Tensor, value_states: torch.Tensor, *, ends_prompt: bool = True) -> ForwardStep:
        """Take the q new post-RoPE keys/values [B, Hkv, q, d] of a forward; return its :class:`ForwardStep`.

        Prefill: they join the unstored prompt, which the step attends. Decode: they are appended to the stores,
        and the step attends the stores (:meth:`reads_stores`) or their dense view. ``ends_prompt``: whether
        the prompt is complete after this forward (False between the chunks of a chunked prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_states, value_states = self._codes(key_states, value_states)
        B, Hkv, q, _ = key_states.shape
        have = self.prompt.positions.shape[0] if self.prompt is not None else (self.storage.shape or (B,))[0]
        if have != B:
            raise RuntimeConfigError(f"layer {self.layer_idx}: the cache holds a batch of {have} "
                                     f"but this forward has {B}; start a new cache with session.new_cache()")
        stores = None
        if not self.prefilled:
            pos = torch.arange(self.tokens_seen, self.tokens_seen + q, device=key_states.device)
            pos = pos.view(1, 1, q).expand(B, Hkv, q)
            raw = self.prompt
            if raw is None:
                self.prompt = StorageView(keys=key_states, values=value_states, positions=pos.contiguous(), valid=None)
            else:
                self.prompt = StorageView(keys=torch.cat([raw.keys, key_states], dim=2),
                                          values=torch.cat([raw.values, value_states], dim=2),
                                          positions=torch.cat([raw.positions, pos], dim=-1), valid=None)
            view = self.prompt
        else:
            self.storage.append(key_states, value_states, self.tokens_seen)
            if self.reads_stores():  # attention reads the stores (polykv.attention.online_softmax); no dense view is built
                stores = self.storage
                view = StorageView(keys=key_states, values=value_states, positions=None, valid=None)
            else:
                view = self.storage.view()
        spec = self.spec
        return ForwardStep(layer_idx=self.layer_idx, phase="decode" if self.prefilled else "prefill", view=view,
                           stores=stores, first_position=self.tokens_seen, states=tuple(self.observing_states()),
                           ends_prompt=ends_prompt, attention_type=spec.attention_type, window=spec.window)

    def _codes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A low-rank layer's codes ``P^T k``, ``U^T v`` of the new post-RoPE keys/values (projected as they
        arrive, so nothing full width is stored or scored); the tensors themselves for a full-width layer."""
        if self.low_rank is None:
            return key_states, value_states
        return self.low_rank.codes(key_states, value_states)

    def reads_stores(self) -> bool:
        """Whether this decode forward attends straight from the stores
        (:func:`polykv.attention.online_softmax.decode_attention_from_stores`, per head for a ragged layer) instead
        of the dense view: a full-attention layer with plain softmax attention whose stores read in token
        blocks, no rule state observing every forward (states read the dense keys), and something the view
        would cost: a quantized stream (dequantizing the whole layer) or ragged heads (padding them to
        the longest). A uniform 16-bit layer's view is its buffers, so it keeps SDPA over them. An
        eviction still builds the view, in the forwards where it fires."""
        plan, st = self.spec.plan, self.storage
        if not (self.read_stores and self.plain_attention and self.spec.window is None):
            return False
        if not st.ragged and plan.k_bits == PASSTHROUGH_BITS and plan.v_bits == PASSTHROUGH_BITS:
            return False
        pair = (st.segments[0].key, st.segments[0].value) if st.ragged else (st.key_store, st.value_store)
        if not all(callable(getattr(x, "token_blocks", None)) for x in pair):  # every store is built alike
            return False
        return not self.observing_states()

    # -- after attention -------------------------------------------------------------------------
    def observing_states(self) -> list:
        """Every distinct state that observes this layer's forwards."""
        out = []
        for st in [self.states["prefill"], self.states["decode"], *self.extra_states]:
            if st is not None and all(st is not o for o in out):
                out.append(st)
        return out

    def after_attention(self, step: ForwardStep, query: torch.Tensor, scaling: float, signals=None, *,
                        plain: bool = True) -> None:
        """Finish ``step`` (from :meth:`begin`): let every state observe the q new queries [B, H, q, d] (on a
        low-rank layer as key codes [B, H, q, k_rank]), then select (prefill) or evict (decode).

        ``signals``: the :class:`~polykv.contract.state.AttentionSignals` the attention pass computed, if any.
        ``plain``: whether the model's attention was a plain softmax (no softcap, no sinks): a later decode
        forward reads the stores only then."""
        self.plain_attention = plain
        view = step.view
        states = step.states
        if states and self.low_rank is not None:  # the states read queries as the stored keys are: key codes
            query = self.low_rank.queries(query)
        if states:
            obs = Observation(layer_idx=self.layer_idx, phase=step.phase,
                              query=query, keys=view.keys, positions=view.positions, valid=view.valid,
                              first_position=step.first_position, scaling=scaling, signals=signals,
                              rope_inv_freq=self.settings.rope_inv_freq, probe=step.probe)
            for st in states:
                st.observe(obs)
        if step.probe is not None:  # the probe's keys and values go with its step; nothing is stored or counted
            if self.pending is step:
                self.pending = None
            return
        self.tokens_seen += query.shape[2]
        self.scaling = scaling
        try:
            if not self.prefilled:
                if step.ends_prompt:
                    self.end_prefill()
            else:
                self._maybe_evict(step)
                for st in states:
                    st.after_decode_step()
        finally:
            if self.pending is step:
                self.pending = None

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
        if self.share_lower is not None and self.prefilled:
            out["share_index"] = self.storage.share_index_bytes()
        return out
