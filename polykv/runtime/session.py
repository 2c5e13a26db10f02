"""``apply(model, plan)``: validate a plan against a model, then run it inside a ``with`` block.

>>> with polykv.apply(model, plan) as session:                     # doctest: +SKIP
...     out = model.generate(input_ids, max_new_tokens=64)
...     print(session.resident_bytes().total)

Inside the block the model's attention implementation is ``polykv`` and ``model.generate`` gets a
fresh plan cache unless one is passed; manual loops pass ``cache=session.new_cache()`` (then
``session.cache``; on transformers without the ``cache`` keyword, the older keyword
:func:`polykv.runtime.cache.cache_keyword` names). On exit the attention implementation is restored and ``generate`` is
unpatched. Every model forward in the block goes through :meth:`Session.guarded_forward` (one caller at a time,
:class:`OneCaller`; a plan's probe after the prompt); ``generate`` and ``prefill`` are :mod:`polykv.runtime.calls`;
the checks ``apply`` makes are :mod:`polykv.runtime.checks`; the attention swap is
:func:`polykv.attention.attach.attached`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Mapping

import attrs
import torch

from polykv.attention import attach
from polykv.contract.model_data import NEED_ATTRIBUTE
from polykv.contract.params import token_id_params
from polykv.contract.rules import checks_enabled
from polykv.errors import RuntimeConfigError
from polykv.attention.low_rank import LowRank
from polykv.models.geometry import FULL, ModelGeometry, geometry_of_model, rope_of_model
from polykv.models.kv_bases import KV_BASES_KEY
from polykv.plan import LayerPlan, OpSpec, Plan, uniform_plan, validate_plan
from polykv.registry import get_registry
from polykv.runtime import calls
from polykv.runtime.cache import LEGACY_CACHE_KEYWORD, PlanCache, cache_keyword, given_cache
from polykv.runtime.layer_spec import CacheSettings, LayerSpec
from polykv.runtime.probe_pass import ProbePass
from polykv.runtime.checks import (SERVED, attention_modules, check_layer_shapes, check_model_data,
                                   check_probe_phases, check_rank_rules, check_seed, check_servable, check_stores,
                                   model_type, plain_softmax, plan_model_data)
from polykv.runtime.storage import quantizer_of
from polykv.runtime.tokenizer_params import check_token_ids, check_tokenizer, fill_tokenizer_params

SUPPORTED_ATTN = ("sdpa", "eager")
_MISSING = object()


@attrs.define(frozen=True)
class ResidentBytes:
    """Bytes a cache holds, per layer and in total; metadata is reported apart from K/V."""

    per_layer: tuple[int, ...]
    """K + V store bytes per layer: codes + scales/zeros + full-precision residuals."""
    metadata_per_layer: tuple[dict, ...]
    """Per layer: ``positions`` (int64, 8 bytes per stored token per KV head) and ``rule_state``
    (the bytes of every rule state the layer keeps, e.g. H2O's float32 accumulated attention or a
    query window)."""
    bases: int = 0
    """Bytes of the key/value bases the cache's low-rank layers project with (held once, whatever the
    batch or context; not in :attr:`total`)."""

    @property
    def total(self) -> int:
        return sum(self.per_layer)

    @property
    def metadata_total(self) -> int:
        return sum(sum(m.values()) for m in self.metadata_per_layer)


def apply(model, plan: Plan, *, model_data: Mapping[str, Any] | None = None, registry=None,
          seed: int = 0, storage_dtype: torch.dtype | None = None, check: bool | None = None,
          tokenizer=None, missing_model_data: str = "compute") -> "Session":
    """Check ``plan`` against ``model`` and the registry; return a :class:`Session` to use in ``with``.

    Per-model data the plan's rules read (TriAttention's query statistics; :mod:`polykv.contract.model_data`)
    comes from ``model_data={key: data}``, else the file the plan names for it (``plan.model_data``,
    e.g. the profile's side file), else the cache under ``$POLYKV_CACHE`` or ``~/.cache/polykv`` (by
    model fingerprint). When none holds it, ``missing_model_data="compute"`` (the default) computes it
    over the offline corpus with ``tokenizer`` (default: the one saved beside a model loaded from a
    folder), notes the cost in one line and caches it; ``"refuse"`` raises, naming the files looked for.

    Rule parameters that come from the model's tokenizer (KVzip's prompt token ids, a rule's
    ``tokenizer_params``) and that the plan leaves unset are built from ``tokenizer`` (a tokenizer object; default:
    the one saved beside a model loaded from a local folder), and token ids are checked against the vocabulary.

    ``storage_dtype`` (e.g. ``torch.bfloat16`` while the model computes in float32) is the dtype the
    cache keeps unquantized K/V, quantizer scales and residuals in; attention reads them back in the
    compute dtype. None keeps them in the compute dtype.

    ``check=True`` runs the expensive plugin contract checks as well as the cheap ones that always run
    (:mod:`polykv.runtime.plugin_results`); None: the environment variable ``POLYKV_CHECK=1`` decides.

    Raises
    ------
    PlanError
        The plan names unknown rules/quantizers, a rule in a phase it does not support, or was made
        for another model (layer count, KV heads, head dim, fingerprint), or quantizer parameters
        that cannot serve the model's head dim.
    RuntimeConfigError
        The model cannot be served (:mod:`polykv.runtime.checks`: latent, differential or recurrent
        attention, KV sharing), or uses an attention implementation the runtime cannot replace;
        :class:`polykv.contract.model_data.ModelDataError` when a rule's per-model data is missing (and cannot
        be computed) or was measured on another model.
    """
    if registry is None:
        registry = get_registry()
    check_servable(model)
    if not isinstance(plan, Plan):
        raise RuntimeConfigError(f"apply(model, plan) needs a polykv Plan, got a {type(plan).__name__}; load a plan "
                                 f"file with polykv.load_plan(path) or build one with polykv.uniform_plan(...)")
    check_seed(seed)
    if tokenizer is not None:
        check_tokenizer(tokenizer)
    geometry = geometry_of_model(model)
    impl = model.config._attn_implementation
    if impl == attach.NAME:
        raise RuntimeConfigError("this model is already inside a polykv session; leave that with-block first")
    if impl not in SUPPORTED_ATTN:
        raise RuntimeConfigError(
            f"the model uses attn_implementation '{impl}'; the polykv runtime replaces attention with its own SDPA "
            f"kernel and supports models loaded with {list(SUPPORTED_ATTN)} (reload with attn_implementation='sdpa')")
    validate_plan(plan, registry=registry, geometry=geometry)
    rules = [registry.rule(name) for name in sorted(plan.rules_used())]
    if any(cls.declares_probe() for cls in rules):
        check_probe_phases(plan, registry)
    if any(getattr(cls, "tokenizer_params", ()) or token_id_params(cls.param_specs) for cls in rules):
        plan = fill_tokenizer_params(plan, registry, model, tokenizer)
        check_token_ids(plan, registry, model)
    if plan.low_rank:
        check_rank_rules(plan, registry)
    if storage_dtype is not None and (not isinstance(storage_dtype, torch.dtype) or not storage_dtype.is_floating_point):
        raise RuntimeConfigError(f"storage_dtype must be a floating-point torch dtype (torch.bfloat16, torch.float16, "
                                 f"torch.float32), got {storage_dtype!r}")
    if any(lp.quantized for lp in plan.layers):
        check_stores(plan, registry, geometry, next(model.parameters()).dtype)
    if model_data is not None:
        check_model_data(model_data, plan, registry, model)
    modules = attention_modules(model, geometry.num_layers)
    check_layer_shapes(model, modules, geometry)
    data = {}   # per-model data: given, read by rules that declare it, or a layer's ranks (their bases)
    if model_data is not None or plan.low_rank or any(getattr(cls, NEED_ATTRIBUTE, None) for cls in rules):
        data = plan_model_data(model, plan, registry, geometry, given=model_data, tokenizer=tokenizer,
                               missing=missing_model_data, run_probe=run_probe)
    session = Session(model, plan, registry=registry, modules=modules, model_data=data, seed=seed,
                      geometry=geometry)
    session.storage_dtype = storage_dtype
    session.check = checks_enabled(check)
    return session


def layer_spec(lp: LayerPlan, registry, geometry: ModelGeometry | None = None,
               model_data: Mapping[str, Any] | None = None, *, plain: bool = True) -> LayerSpec:
    """The :class:`~polykv.runtime.layer_spec.LayerSpec` of plan layer ``lp``: its rule and quantizer objects from
    ``registry``, its attention type and window from ``geometry`` (None: full attention), its bases from
    ``model_data`` when the plan gives it a rank; ``plain``: no softcap or sinks on its attention module."""
    rules = {}
    for phase in ("prefill", "decode"):
        op = getattr(lp, phase)
        rules[phase] = None if op.keeps_everything else registry.rule(op.rule)(**op.params)
    windowed = geometry is not None and geometry.is_windowed(lp.layer)
    return LayerSpec(plan=lp, prefill_rule=rules["prefill"], decode_rule=rules["decode"],
                     quantizer=quantizer_of(registry, lp),
                     attention_type=geometry.layer_types[lp.layer] if windowed else FULL,
                     window=geometry.sliding_window if windowed else None,
                     token_bound=geometry.token_bound(lp.layer) if geometry is not None else None,
                     low_rank=_low_rank(lp, model_data or {}) if lp.low_rank else None, plain=plain)


def _low_rank(lp: LayerPlan, model_data: Mapping[str, Any]) -> LowRank:
    """The bases of a layer the plan gives a rank."""
    bases = model_data[KV_BASES_KEY]
    return LowRank(None if lp.k_rank is None else bases.basis("key", lp.layer, lp.k_rank),
                   None if lp.v_rank is None else bases.basis("value", lp.layer, lp.v_rank))


class OneCaller:
    """A session serves one call at a time: its cache holds the sequences of one ``generate``, ``prefill``
    or forward. A call (and the forwards it makes) claims the session for its thread; a call from another
    thread meanwhile is refused in one line, instead of replacing the cache under the running one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def check(self, what: str) -> None:
        owner = self._owner
        if owner is not None and owner != threading.get_ident():
            raise RuntimeConfigError(
                f"{what} was called from a second thread while another thread's call runs in this polykv session; "
                f"a session serves one generate/prefill/forward at a time (it holds one cache): give each thread its "
                f"own model copy and polykv.apply session, or serialise the calls with a lock")

    @contextlib.contextmanager
    def claim(self, what: str):
        me = threading.get_ident()
        with self._lock:
            self.check(what)
            self._owner, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None


_ACTIVE_MARK = "_polykv_active_session"
"""Attribute set on a model while a session is active on it (sessions on one model do not nest)."""


class Session:
    """A plan applied to a model; the live state of one ``with`` block."""

    def __init__(self, model, plan: Plan, *, registry, modules, model_data: Mapping[str, Any], seed: int,
                 geometry: ModelGeometry):
        self.model, self.plan, self.registry, self.seed = model, plan, registry, seed
        self.model_data, self.geometry = model_data, geometry
        self.storage_dtype: torch.dtype | None = None
        """dtype the cache stores K/V in (None: the compute dtype); set by :func:`apply`."""
        self.check = False
        """Whether the expensive plugin contract checks run; set by :func:`apply`."""
        self._modules = modules
        self._specs = [layer_spec(lp, registry, geometry, model_data, plain=plain_softmax(modules[lp.layer]))
                       for lp in plan.layers]
        probing = [(s.plan.layer, s.prefill_rule) for s in self._specs
                   if s.prefill_rule is not None and s.prefill_rule.declares_probe()]
        self.probe: ProbePass | None = ProbePass(model, geometry, probing, cache_keyword(model)) if probing else None
        """The plan's probe (a model pass after the prompt, :mod:`polykv.runtime.probe_pass`), or None without one."""
        self._groups = tuple((g, registry.allocator(g.allocator)(**g.params)) for g in plan.allocation)
        self.rope_inv_freq, self.rope_scaling = rope_of_model(model)
        self._cache: PlanCache | None = None
        self._active = False
        self._exit: contextlib.ExitStack | None = None
        self.one_caller = OneCaller()
        """Lets one thread's call (a forward, ``generate``, ``prefill``) in at a time."""
        self.uncached_thread: int | None = None
        """The thread whose ``generate(use_cache=False)`` runs now: each of its forwards gets a fresh cache."""
        self._cache_kw = cache_keyword(model)
        self.attention_inputs = attach.AttentionInputs(enumerate(modules))
        """The pre-hooks that keep the attention input of the layers whose states read it (none: no hook)."""

    # -- context manager ---------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        if self._active:
            raise RuntimeConfigError("this session is already active; nest a new polykv.apply(...) instead")
        other = self.model.__dict__.get(_ACTIVE_MARK)
        if other is not None and other is not self:
            raise RuntimeConfigError("this model is already inside a polykv session; leave that with-block first "
                                     "(sessions on one model do not nest)")
        model = self.model
        with contextlib.ExitStack() as stack:
            stack.enter_context(attach.attached(model, self._modules))
            stack.callback(self.attention_inputs.unhook)
            for name, patched in (("generate", functools.update_wrapper(functools.partial(calls.generate, self),
                                                                        calls.generate)),
                                  ("forward", self.guarded_forward(model.forward))):
                stack.callback(_restore, model, name, model.__dict__.get(name, _MISSING))
                setattr(model, name, patched)
            model.__dict__[_ACTIVE_MARK] = self
            stack.callback(model.__dict__.pop, _ACTIVE_MARK, None)
            stack.callback(model.register_forward_hook(self._check_every_layer_attended).remove)
            self._exit = stack.pop_all()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._exit is not None:
            self._exit.close()
            self._exit = None

    def _check_every_layer_attended(self, module, args, output) -> None:
        """After each model forward: every layer whose cache was updated ran polykv's attention function
        (a model that computes attention itself would otherwise return output polykv did not make)."""
        cache = self._cache
        if cache is None:
            return
        missed = [layer.layer_idx for layer in cache.layers if not layer.attended]
        if missed:
            for layer in cache.layers:
                layer.attended = True
            raise RuntimeConfigError(
                f"model type '{model_type(self.model)}': layers {missed} stored keys but computed attention without "
                f"the polykv attention function; this model cannot be served (supported are {SERVED})")

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """The resolved spec of every plan layer (its rule objects, window, bases), in layer order."""
        return tuple(self._specs)

    @property
    def allocation_groups(self) -> tuple:
        """``(group, allocator object)`` of every allocation group of the plan."""
        return tuple(self._groups)

    @property
    def attention_modules(self) -> tuple[torch.nn.Module, ...]:
        """The model's attention module of every layer, in layer order (what the session patches)."""
        return tuple(self._modules)

    def require_active(self) -> None:
        if not self._active:
            raise RuntimeConfigError("use the session inside its with-block: 'with polykv.apply(model, plan) as s:'")

    def guarded_forward(self, forward):
        """``model.forward`` inside the block: one caller at a time (:class:`OneCaller`); inside an uncached
        ``generate`` every forward gets a fresh cache (it recomputes the whole sequence, as vanilla does); a plan
        with a probe runs it after the prompt (:mod:`polykv.runtime.probe_pass`)."""

        @functools.wraps(forward)
        def guarded(*args, **kwargs):
            with self.one_caller.claim("a model forward"):
                if self.uncached_thread == threading.get_ident():  # generate hands back the last one: replace it
                    kwargs.pop(LEGACY_CACHE_KEYWORD, None)
                    kwargs[self.cache_keyword] = self.new_cache()
                cache = given_cache(kwargs, self.cache_keyword)
                if self.probe is not None and isinstance(cache, PlanCache) and cache.probe is None \
                        and not any(layer.prefilled for layer in cache.layers):
                    return self.probe.prompt_forward(forward, cache, args, kwargs)
                return forward(*args, **kwargs)

        return guarded

    # -- caches ----------------------------------------------------------------------------------
    def new_cache(self) -> PlanCache:
        """A fresh, empty plan cache; it becomes :attr:`cache`."""
        self.require_active()
        self.one_caller.check("new_cache()")
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        inv = self.rope_inv_freq.to(device) if self.rope_inv_freq is not None else None
        settings = CacheSettings(decode_slack=self.plan.trigger.decode_slack, storage_dtype=self.storage_dtype,
                                 check=self.check, rope_inv_freq=inv, rope_scaling=self.rope_scaling,
                                 model_data=self.model_data, generator=gen,
                                 attention_inputs=self.attention_inputs.held)
        self._cache = PlanCache(specs=self._specs, settings=settings, groups=self._groups)
        self.attention_inputs.hook_readers(self._cache.layers)   # the layers whose states read it
        return self._cache

    @property
    def cache_keyword(self) -> str:
        """The keyword the model's forward takes the cache by: ``"cache"`` where the installed transformers
        has it, else the older keyword (:func:`polykv.runtime.cache.cache_keyword`)."""
        return self._cache_kw

    @property
    def cache(self) -> PlanCache | None:
        """The live cache: the last one created by :meth:`new_cache`, ``generate`` or :meth:`prefill`."""
        return self._cache

    def prefill(self, input_ids: torch.Tensor, *, chunk_size: int | None = None, **model_kwargs):
        """Prefill a fresh cache with ``input_ids`` [B, T], in chunks of ``chunk_size`` tokens
        (:func:`polykv.runtime.calls.prefill`); returns the last chunk's model output."""
        return calls.prefill(self, input_ids, chunk_size=chunk_size, **model_kwargs)

    def note_context(self, context_tokens: int) -> None:
        """Warn once per plan when absolute capacities meet another context length
        (:func:`polykv.runtime.calls.note_context`)."""
        calls.note_context(self, context_tokens)

    def resident_bytes(self) -> ResidentBytes:
        """K/V bytes per layer and in total, with metadata reported separately (see docs/runtime.md)."""
        if self._cache is None:
            raise RuntimeConfigError("no cache yet: run generate(), prefill() or a forward with session.new_cache()")
        layers = self._cache.layers
        return ResidentBytes(per_layer=tuple(layer.kv_bytes() for layer in layers),
                             metadata_per_layer=tuple(layer.metadata_bytes() for layer in layers),
                             bases=sum(layer.bases_bytes() for layer in layers))

    def allocations(self) -> dict[int, dict[str, Any]]:
        """What the plan's allocators gave each layer of the live cache (see ``PlanCache.allocations``)."""
        if self._cache is None:
            raise RuntimeConfigError("no cache yet: run generate(), prefill() or a forward with session.new_cache()")
        return self._cache.allocations()


def _restore(model, name: str, saved) -> None:
    if saved is _MISSING:
        model.__dict__.pop(name, None)
    else:
        setattr(model, name, saved)


def run_probe(model, rule: str, params: dict, ids: torch.Tensor) -> list:
    """The runtime's :data:`polykv.contract.probe.ProbeRunner`: one prompt forward and its probe under a plan that
    keeps every token with ``rule`` in every layer's prefill; each layer's prefill state as the probe left it."""
    T = int(ids.shape[-1])
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule=rule, capacity=T, params=dict(params)),
                        decode="full")
    with torch.no_grad(), apply(model, plan, missing_model_data="refuse") as session:
        cache = session.new_cache()
        states = [layer.states["prefill"] for layer in cache.layers]   # the layers drop them once stored
        model(ids, use_cache=True, **{session.cache_keyword: cache})
    return states

