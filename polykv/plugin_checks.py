"""Plugin contract checks: :func:`check_rule`, :func:`check_quantizer` and :func:`check_allocator` run a plugin
class through the runtime on a tiny random-weight model and the contract's invariants, failing with
:class:`~polykv.errors.PluginContractError` naming what broke: a plugin's own tests import them from here. The tiny
models and the vanilla-equality checks stay in :mod:`polykv.testing`.
"""

from __future__ import annotations

import types

import attrs
import torch

from polykv.contract.allocators import Allocator
from polykv.contract.hookspecs import hookimpl
from polykv.contract.model_data import compute_data, need_of
from polykv.contract.rules import PHASES, ScoredRule
from polykv.contract.selection import Merge, Selection
from polykv.contract.stores import WriteCost
from polykv.errors import PluginContractError, RegistryError
from polykv.models.geometry import geometry_of_model
from polykv.plan import AllocationGroup, OpSpec, per_layer_plan, uniform_plan
from polykv.registry import Registry
from polykv.runtime.plugin_results import store_head
from polykv.runtime.session import apply, run_probe
from polykv.testing import feed_random, tiny_model

_CHECK_MODELS: dict = {}


def _contract_model(layers: int, head_dim: int):
    key = (layers, head_dim)
    if key not in _CHECK_MODELS:
        _CHECK_MODELS[key] = tiny_model("llama", layers=layers, heads=4, kv_heads=2, head_dim=head_dim, seed=0)
    return _CHECK_MODELS[key]


def _registry_with(kind: str, cls, registry=None, extra: tuple = ()):
    """A registry holding ``cls`` under its name (registered on a private registry unless it is there already)."""

    registry = registry if registry is not None else Registry(load_entry_points=False)
    hooks = {"rule": "register_rules", "quantizer": "register_quantizers", "allocator": "register_allocators"}
    for k, c in ((kind, cls), *extra):
        if registry.has(k, c.name):
            if registry.get(k, c.name) is not c:
                raise RegistryError(f"{k} name '{c.name}' is already registered by "
                                    f"'{registry.entry(k, c.name).plugin}' for another class; rename the plugin")
            continue
        hook = hookimpl(lambda register, _c=c: register(_c))
        registry.register_plugin(types.SimpleNamespace(**{hooks[k]: hook}), name=f"checked-{k}-{c.name}")
    return registry


def _run_checked(model, plan, registry, *, prompt: int, steps: int, batch: int = 1, model_data=None, seed: int = 0,
                 storage_dtype=None, counted: tuple = ()):
    """Prefill ``prompt`` random tokens and decode ``steps`` under ``plan`` with every check on; returns the
    session (closed) and how often each counted rule object's ``select`` ran, per phase."""
    geo = geometry_of_model(model)
    calls = {"prefill": 0, "decode": 0}
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    with torch.no_grad(), apply(model, plan, registry=registry, model_data=model_data, check=True,
                                       storage_dtype=storage_dtype) as session:
        for spec in session.layer_specs:
            for phase, rule in (("prefill", spec.prefill_rule), ("decode", spec.decode_rule)):
                if rule is not None and type(rule) in counted:
                    rule.select = _counting(rule.select, calls, phase)
        cache = session.new_cache()
        chunks = None
        if session.probe is not None:  # a probe rule: the prompt waits, the probe's forwards run, then layers select
            chunks = session.probe.chunks_for(torch.randint(1, int(model.config.vocab_size), (batch, prompt), generator=gen))
            cache.prefill_continues = True
        feed_random(cache, geo, prompt, gen, dtype, batch)
        if chunks is not None:
            cache.prefill_continues = False
            for chunk in chunks:
                cache.probe = chunk
                feed_random(cache, geo, chunk.num_tokens, gen, dtype, batch)
            cache.end_probe(chunks)
        for q in [1] * steps:
            feed_random(cache, geo, q, gen, dtype, batch)
        bytes_after = session.resident_bytes()
    return session, calls, bytes_after


def _counting(select, calls: dict, phase: str):
    def counted(ctx, capacity):
        calls[phase] += 1
        return select(ctx, capacity)
    return counted


def _helper_plugins():
    """The checkers' own plugins (no built-in is named): a rule keeping the largest key norms, a rule keeping
    the newest tokens that merges each evicted value into the newest kept one, and an allocator giving the
    two halves of a layer's KV heads unequal budgets (per-head budgets, ragged storage)."""

    class KeepLargeKeys(ScoredRule):
        name = "polykv-testing-keep"

        def score(self, ctx):
            return ctx.keys.float().norm(dim=-1)

    class MergeIntoNewest(ScoredRule):
        name = "polykv-testing-merge"
        phases = frozenset({"decode"})

        def score(self, ctx):
            return ctx.positions.float()

        def select(self, ctx, capacity):
            index = super().select(ctx, capacity)                                   # [B, Hkv, capacity]
            B, Hkv, T = ctx.positions.shape
            E = T - capacity
            evicted = torch.arange(E, device=index.device).expand(B, Hkv, E)          # the oldest are evicted
            targets = index[..., -1:].unsqueeze(-1).expand(B, Hkv, E, 1)
            weights = torch.full(targets.shape, 1.0 / (E + 1), device=index.device)
            return Selection(index=index, merge=Merge(evicted=evicted, targets=targets, weights=weights))

    class UnevenHeads(Allocator):
        name = "polykv-testing-uneven-heads"

        def layer_statistic(self, ctx):
            return 0.0

        def allocate(self, request):
            caps = torch.tensor([request.capacities[request.group_layers.index(i)] for i in request.layers])
            shift = torch.arange(request.num_kv_heads) % 2 * 2 - 1                      # -1, +1, -1, ...
            return (caps.view(-1, 1) + shift * (caps.view(-1, 1) // 4)).clamp_min(1)

        def bound(self, capacities, context_tokens):
            return [min(c + c // 4, context_tokens) for c in capacities]

    return {"keep": KeepLargeKeys, "merge": MergeIntoNewest, "uneven": UnevenHeads}


_HELPERS: dict = {}


def _helpers(registry=None, kind=None, cls=None):
    """The helper plugins, and ``registry`` (private unless given) holding them and ``cls`` of ``kind``."""
    if not _HELPERS:
        _HELPERS.update(_helper_plugins())
    extra = (("rule", _HELPERS["keep"]), ("rule", _HELPERS["merge"]), ("allocator", _HELPERS["uneven"]))
    return _HELPERS, _registry_with(kind, cls, registry, extra=extra)


def check_rule(rule_class, params=None, *, capacity: int = 12, prompt: int = 40, steps: int = 8, batch: int = 2,
               ragged: bool = True, model_data=None, registry=None, seed: int = 0) -> dict:
    """Run retention rule ``rule_class`` (with ``params``) through the runtime with every contract check on.

    A 2-layer tiny model (4 query heads, 2 KV heads, head dim 16), batch ``batch``, a ``prompt``-token
    prefill and ``steps`` decode steps with decode slack 1. Layer 0 runs the rule in each phase it
    supports on uniform storage; layer 1 runs it on per-head budgets (prefill, from an allocator
    giving the KV heads unequal budgets) and on ragged storage (decode; after such a prefill by a helper rule
    when the rule
    has no prefill); ``ragged=False`` leaves layer 1 out, for a rule that refuses both. A rule declaring ``model_data_need`` gets its data computed on the tiny model
    unless ``model_data`` is given. Returns ``{"prefill": n, "decode": m}``, how often ``select`` ran.

    Raises :class:`~polykv.errors.PluginContractError` (one line naming the rule, layer and phase) when
    a score, selection or merge breaks the contract, and when ``select`` never ran in a phase the rule
    declares.
    """

    params = dict(params or {})
    rule_class(**params)  # parameters are checked as plan validation would
    helpers, registry = _helpers(registry, "rule", rule_class)
    model = _contract_model(2, 16)
    geo = geometry_of_model(model)
    op = OpSpec(rule=rule_class.name, capacity=capacity, params=params)
    phases = rule_class.phases
    first = {ph: op for ph in PHASES if ph in phases}
    second = dict(first)
    if "prefill" not in phases:
        second["prefill"] = OpSpec(rule=helpers["keep"].name, capacity=capacity)
    plan = per_layer_plan(geo, [first, second if ragged else {}], decode_slack=1)
    if ragged:
        plan = attrs.evolve(plan, allocation=(AllocationGroup(allocator=helpers["uneven"].name, layers=(1,)),))
    need = need_of(rule_class)
    if need is not None and model_data is None:
        gen = torch.Generator().manual_seed(seed)
        model_data = {need.key: compute_data(need, model, [torch.randint(1, 128, (1, 64), generator=gen)],
                                             run_probe=run_probe)}
    _, calls, _ = _run_checked(model, plan, registry, prompt=prompt, steps=steps, batch=batch,
                               model_data=model_data, seed=seed, counted=(rule_class,))
    for phase in sorted(phases):
        if not calls[phase]:
            raise PluginContractError(f"layer 0 ({phase}): rule '{rule_class.name}' select() never ran with "
                                      f"capacity {capacity} on a {prompt}-token prompt; give check_rule a smaller "
                                      f"capacity")
    return calls


def _store_check_head(name, bits, stream, what: str) -> str:
    return f"{store_head(0, 'check', name, bits, stream)} {what}"


def check_quantizer(quantizer_class, params=None, *, bits=None, tokens: int = 70, head_dim: int = 32,
                    registry=None, seed: int = 0) -> list[tuple[str, int]]:
    """Check quantizer ``quantizer_class`` (with ``params``) against the store contract, for every width of
    ``bits`` (default: all it declares) and both streams, on random [1, 2, tokens, head_dim] tensors:
    * ``predict_bytes`` equals ``resident_bytes()`` after ``tokens`` appends in two chunkings, which
      store the same codes; ``predict_reserved_bytes`` equals it after ``reserve`` (below and above);
    * ``len``, ``dequantize()`` shape and dtype, in float32 and (as ``storage_dtype``) bfloat16;
    * ``gather`` keeps the survivors' values exactly (codes and scales survive);
    * ``write`` (when the store has one) returns a :class:`~polykv.contract.stores.WriteCost` with
      ``tokens_written`` the masked count, and changes no token it did not write or re-encode;
    * ``split_heads`` (when it has one) gives each head its own tokens unchanged;
    * then a plan routing the quantizer to a tiny model's layer runs prefill and decode with every runtime
      check on (resident bytes after prefill equal the prediction; lengths and shapes after every call),
      merging into the stores when they can be written.

    Returns the (stream, bits) pairs checked. Raises :class:`~polykv.errors.PluginContractError`, one line
    naming the quantizer, stream and width.
    """

    params = dict(params or {})
    quantizer = quantizer_class(**params)
    widths = sorted(quantizer_class.bits if bits is None else bits)
    name = quantizer_class.name
    g = torch.Generator().manual_seed(seed)
    done = []
    writable = True
    for width in widths:
        for stream in ("key", "value"):
            def fail(what, _w=width, _s=stream):
                raise PluginContractError(_store_check_head(name, _w, _s, what))

            writable &= _check_store(quantizer, stream, width, tokens, head_dim, g, fail, WriteCost)
            done.append((stream, width))
    helpers, registry = _helpers(registry, "quantizer", quantizer_class)
    model = _contract_model(2, head_dim)
    geo = geometry_of_model(model)
    keep = max(2, tokens - 8)
    decode = OpSpec(rule=helpers["merge" if writable else "keep"].name, capacity=keep)
    for width in widths:
        layers = [{"prefill": OpSpec(rule=helpers["keep"].name, capacity=keep), "decode": decode, "k_bits": width,
                   "v_bits": width, "quantizer": name, "quantizer_params": params},
                  {"k_bits": width, "quantizer": name, "quantizer_params": params}]   # 16-bit values beside
        plan = per_layer_plan(geo, layers, decode_slack=2)
        for storage_dtype in (None, torch.bfloat16):
            _run_checked(model, plan, registry, prompt=tokens, steps=6, seed=seed, storage_dtype=storage_dtype)
    return done


def _check_store(quantizer, stream, bits, T, d, g, fail, WriteCost) -> bool:
    """The tensor-level store checks of :func:`check_quantizer` for one stream and width; True when the store
    has a write path."""
    B, Hkv = 1, 2
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(B, Hkv, T, d, generator=g).to(dtype)
        shape = dict(batch=B, kv_heads=Hkv, head_dim=d, dtype_bytes=x.element_size())
        predicted = int(quantizer.predict_bytes(stream, bits, tokens=T, **shape))
        stores = []
        for cuts in ([T], [1, T // 3, T - 1 - T // 3]):
            store = quantizer.new_store(stream, bits, dtype=dtype, device=x.device)
            start = 0
            for n in cuts:
                store.append(x[:, :, start:start + n])
                start += n
                if len(store) != start:
                    fail(f"holds len(store) = {len(store)} after appending {start} tokens in chunks {cuts}; "
                         f"expected {start} (fix append or __len__)")
            got = int(store.resident_bytes())
            if got != predicted:
                fail(f"holds {got} resident bytes for {T} tokens ({dtype}); expected {predicted} from predict_bytes "
                     f"(count every tensor the store keeps: codes, scales, zeros, residuals)")
            stores.append(store)
        before = stores[0].dequantize()
        if not isinstance(before, torch.Tensor) or tuple(before.shape) != (B, Hkv, T, d) or before.dtype != dtype:
            got = (tuple(before.shape), before.dtype) if isinstance(before, torch.Tensor) else type(before).__name__
            fail(f"dequantize() returned {got}; expected ({B}, {Hkv}, {T}, {d}) {dtype} (fix dequantize())")
        if not torch.equal(before, stores[1].dequantize()):
            fail("stores different values when the same tokens are appended in other chunks (fix append)")
        for reserved in (T // 2, T + 9):
            store = quantizer.new_store(stream, bits, dtype=dtype, device=x.device)
            store.reserve(reserved)
            store.append(x)
            want = int(quantizer.predict_reserved_bytes(stream, bits, tokens=T, reserved=reserved, **shape))
            if int(store.resident_bytes()) != want:
                fail(f"holds {int(store.resident_bytes())} resident bytes after reserve({reserved}) and {T} tokens; "
                     f"expected {want} from predict_reserved_bytes (fix reserve or predict_reserved_bytes)")
    store = stores[0]
    index = torch.stack([torch.tensor([0, 5, T // 2, T - 1]), torch.tensor([1, 2, T // 3, T - 2])]).view(B, Hkv, 4)
    store.gather(index)
    after = store.dequantize()
    if len(store) != 4 or tuple(after.shape) != (B, Hkv, 4, d):
        fail(f"holds len {len(store)}, shape {tuple(after.shape)} after gathering 4 tokens per head; expected 4, "
             f"({B}, {Hkv}, 4, {d}) (fix gather)")
    if not torch.equal(after, before.gather(2, index.unsqueeze(-1).expand(B, Hkv, 4, d))):
        fail("changed the values of tokens a gather kept; survivors must keep their codes and scales (fix gather)")
    store = quantizer.new_store(stream, bits, dtype=x.dtype, device=x.device)
    store.append(x)
    old = store.dequantize()
    mask = torch.rand(B, Hkv, T, generator=g) < 0.2
    try:
        cost = store.write(mask, torch.randn(B, Hkv, T, d, generator=g).to(x.dtype))
    except NotImplementedError:
        writable = False
    else:
        writable = True
        if not isinstance(cost, WriteCost):
            fail(f"write() returned a {type(cost).__name__}; expected a polykv.contract.stores.WriteCost (fix write())")
        n = int(mask.sum())
        new = store.dequantize()
        changed = int(((new != old).any(-1) & ~mask).sum())
        if cost.tokens_written != n or len(store) != T or tuple(new.shape) != tuple(old.shape):
            fail(f"write() of {n} masked tokens reported {cost}, len {len(store)}, shape {tuple(new.shape)}; "
                 f"expected tokens_written = {n}, len {T}, shape {tuple(old.shape)} (fix write())")
        if changed > cost.tokens_requantized:
            fail(f"write() changed {changed} tokens it did not write but reported tokens_requantized = "
                 f"{cost.tokens_requantized}; count every re-encoded token in the WriteCost (fix write())")
    try:
        parts = store.split_heads()
    except NotImplementedError:
        return writable
    whole = store.dequantize()
    if len(parts) != B * Hkv:
        fail(f"split_heads() returned {len(parts)} stores; expected {B * Hkv}, one per (batch row, KV head)")
    for i, part in enumerate(parts):
        want = whole[i // Hkv:i // Hkv + 1, i % Hkv:i % Hkv + 1]
        if len(part) != T or not torch.equal(part.dequantize(), want):
            fail(f"split_heads() store {i} holds len {len(part)} or other values than head {i % Hkv} of batch row "
                 f"{i // Hkv}; expected its {T} tokens unchanged (fix split_heads)")
    return writable


def check_allocator(allocator_class, params=None, *, capacity: int = 10, prompt: int = 40, steps: int = 4,
                    layers: int = 3, registry=None, seed: int = 0, rule=None, rule_params=None,
                    model_data=None) -> dict:
    """Run allocator ``allocator_class`` (with ``params``) over every layer of a ``layers``-layer tiny model
    (a prefill and decode rule keeping the largest key norms at ``capacity`` on each, batch 1) with every
    contract check on:
    budgets of the right shape and dtype, within the allocator's ``bound()``, per-head budgets served; a
    group of all layers and of the odd layers. Also checks that ``bound()`` gives one positive bound per
    layer and that the final budgets sum to at most the group's total. Returns ``session.allocations()``
    of the whole-model group. ``rule`` (a rule class, with ``rule_params``) replaces the prefill rule for an
    allocator that ranks a particular rule's own state (``reads_rule_state``, e.g. ``kvzip``); ``model_data``
    is the per-model data that rule reads.
    """

    params = dict(params or {})
    allocator = allocator_class(**params)
    name = allocator_class.name
    helpers, registry = _helpers(registry, "allocator", allocator_class)
    model = _contract_model(layers, 16)
    geo = geometry_of_model(model)
    keep = helpers["keep"].name
    if rule is not None:
        registry = _registry_with("rule", rule, registry)
    prefill = OpSpec(rule=keep if rule is None else rule.name, capacity=capacity, params=dict(rule_params or {}))
    base = uniform_plan(geo, prefill=prefill, decode=OpSpec(rule=keep, capacity=capacity), decode_slack=1)
    bound = allocator.bound([capacity] * layers, prompt)
    if len(bound) != layers or any(int(b) < 1 for b in bound):
        raise PluginContractError(f"layers {list(range(layers))}: allocator '{name}' bound() returned {list(bound)}; "
                                  f"expected {layers} positive token counts (fix bound())")
    report = None
    for group in (tuple(range(layers)), tuple(range(1, layers, 2))):
        plan = attrs.evolve(base, allocation=(AllocationGroup(allocator=name, layers=group, params=params),))
        session, _, _ = _run_checked(model, plan, registry, prompt=prompt, steps=steps, seed=seed,
                                     model_data=model_data)
        alloc = {i: a for i, a in session.allocations().items()}
        spent = sum(float(torch.tensor(a["budget"], dtype=torch.float64).mean()) for a in alloc.values())
        if sorted(alloc) != list(group) or spent > capacity * len(group):
            raise PluginContractError(f"layers {list(group)} (prefill): allocator '{name}' gave budgets "
                                      f"{ {i: a['budget'] for i, a in alloc.items()} }; expected one per group layer, "
                                      f"at most {capacity * len(group)} tokens per KV head in total (fix allocate())")
        report = report if report is not None else alloc
    return report
