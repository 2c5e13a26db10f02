"""Broken plugins fail in one line naming the plugin, the layer and the phase, through the runtime
(``polykv.apply`` on a tiny model) and through the ``polykv.testing`` checkers; every built-in rule,
quantizer and allocator passes the checkers.

The bad plugins are the mistakes a plugin author makes: scores averaged over heads (``[B, T]``, which a
broadcast would read as per-head scores when B equals Hkv), scores of the wrong length or with NaN,
NaN merge weights, a quantizer returning half-width codes, a ``predict_bytes`` that leaves out the
scales, a store that drops a token on append, an allocator whose budgets have the wrong shape or exceed
its bound.
"""

from __future__ import annotations

import types

import attrs
import pytest
import torch

import polykv
from polykv.contract.allocators import Allocator
from polykv.errors import PluginContractError
from polykv.models.geometry import geometry_of_model
from polykv.contract.rules import ScoredRule
from polykv.contract.stores import KVStore, Quantizer
from polykv.plan import AllocationGroup, OpSpec, per_layer_plan, uniform_plan
from polykv.registry import Registry
from polykv.contract.selection import Merge, Selection
from polykv.plugin_checks import check_allocator, check_quantizer, check_rule
from polykv.testing import tiny_model


# -- bad rules -------------------------------------------------------------------------------------

class MeanOverHeads(ScoredRule):
    """Key norms averaged over the KV heads: [B, T] instead of [B, Hkv, T]."""

    name = "bad-mean-over-heads"

    def score(self, ctx):
        return ctx.keys.float().norm(dim=-1).mean(dim=1)


class OneShort(ScoredRule):
    """Scores for every stored token but the newest: [B, Hkv, T - 1]."""

    name = "bad-one-short"

    def score(self, ctx):
        return ctx.keys.float().norm(dim=-1)[..., :-1]


class NaNScores(ScoredRule):
    """0/0 on every token: NaN scores."""

    name = "bad-nan-scores"

    def score(self, ctx):
        zero = torch.zeros(ctx.positions.shape)
        return zero / zero


class NaNMerge(ScoredRule):
    """Keeps the newest tokens and merges each evicted token into the last kept one with a NaN weight."""

    name = "bad-nan-merge"

    def score(self, ctx):
        return ctx.positions.float()

    def select(self, ctx, capacity):
        index = super().select(ctx, capacity)                                   # [B, Hkv, capacity]
        B, Hkv, T = ctx.positions.shape
        evicted = torch.arange(T - capacity).expand(B, Hkv, T - capacity)
        targets = index[..., -1:].unsqueeze(-1).expand(B, Hkv, T - capacity, 1)
        weights = torch.full(targets.shape, float("nan"))
        return Selection(index=index, merge=Merge(evicted=evicted, targets=targets, weights=weights))


# -- bad quantizers --------------------------------------------------------------------------------

class AbsMaxStore(KVStore):
    """int8 codes [B, Hkv, T, d] with one float32 scale per token and head [B, Hkv, T, 1]."""

    def __init__(self, dtype):
        self.dtype, self.codes, self.scales = dtype, None, None

    def encode(self, x):
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
        return torch.round(x.float() / scale).to(torch.int8), scale

    def append(self, x):
        codes, scale = self.encode(x)
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=2)
        self.scales = scale if self.scales is None else torch.cat([self.scales, scale], dim=2)

    def gather(self, index):
        self.codes = self.codes.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, self.codes.shape[-1]))
        self.scales = self.scales.gather(2, index.unsqueeze(-1))

    def dequantize(self):
        return (self.codes.float() * self.scales).to(self.dtype)

    def __len__(self):
        return 0 if self.codes is None else self.codes.shape[2]

    def resident_bytes(self):
        return 0 if self.codes is None else self.codes.numel() + 4 * self.scales.numel()


class AbsMax8(Quantizer):
    name = "good-absmax8"
    bits = frozenset({8})
    store = AbsMaxStore

    def new_store(self, stream, bits, *, dtype, device):
        return self.store(dtype)

    def predict_bytes(self, stream, bits, *, batch, kv_heads, head_dim, tokens, dtype_bytes):
        return batch * kv_heads * tokens * (head_dim + 4)


class HalfWidthStore(AbsMaxStore):
    """Keeps only every other channel: dequantizes to [B, Hkv, T, d / 2]."""

    def encode(self, x):
        return super().encode(x[..., ::2])


class HalfWidth(AbsMax8):
    name = "bad-half-width"
    store = HalfWidthStore

    def predict_bytes(self, stream, bits, *, batch, kv_heads, head_dim, tokens, dtype_bytes):
        return batch * kv_heads * tokens * (head_dim // 2 + 4)        # consistent with what it (wrongly) keeps


class NoScales(AbsMax8):
    """Predicts the int8 codes and forgets the float32 scales."""

    name = "bad-no-scales"

    def predict_bytes(self, stream, bits, *, batch, kv_heads, head_dim, tokens, dtype_bytes):
        return batch * kv_heads * tokens * head_dim


class DropsTokenStore(AbsMaxStore):
    """An off-by-one: a chunk of more than one token loses its last token."""

    def append(self, x):
        super().append(x[:, :, :-1] if x.shape[2] > 1 else x)


class DropsToken(AbsMax8):
    name = "bad-drops-token"
    store = DropsTokenStore

    def predict_bytes(self, stream, bits, *, batch, kv_heads, head_dim, tokens, dtype_bytes):
        return batch * kv_heads * max(tokens - 1, 0) * (head_dim + 4)


# -- bad allocators --------------------------------------------------------------------------------

class FlatBudgets(Allocator):
    """Returns one budget for the whole group instead of one per layer."""

    name = "bad-flat-budgets"

    def layer_statistic(self, ctx):
        return 0.0

    def allocate(self, request):
        return torch.tensor(request.total)


class AllOnOne(Allocator):
    """Puts the whole group's budget on its first layer, above the bound it declares."""

    name = "bad-all-on-one"

    def layer_statistic(self, ctx):
        return 0.0

    def allocate(self, request):
        out = torch.ones(len(request.layers), dtype=torch.long)
        out[0] = request.total
        return out

    def bound(self, capacities, context_tokens):
        return list(capacities)


def _registry(**by_kind) -> Registry:
    registry = Registry(load_entry_points=False)
    hooks = {"rule": "register_rules", "quantizer": "register_quantizers", "allocator": "register_allocators"}
    for kind, classes in by_kind.items():
        impl = polykv.hookimpl(lambda register, _cs=classes: [register(c) for c in _cs])
        registry.register_plugin(types.SimpleNamespace(**{hooks[kind]: impl}), name=f"bad-{kind}s")
    return registry


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def _run(model, plan, registry, *, batch=1, prompt=20, steps=3, check=None):
    ids = torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), polykv.apply(model, plan, registry=registry, check=check) as session:
        model.generate(ids, max_new_tokens=steps, do_sample=False)
        return session


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- rules -----------------------------------------------------------------------------------------

def test_scores_averaged_over_heads_with_batch_equal_to_kv_heads_fail_through_the_runtime(model):
    """B = Hkv = 2: a [B, T] score broadcast to [1, B, T] would silently use batch row b as head b's scores."""
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule=MeanOverHeads.name, capacity=8))
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, _registry(rule=[MeanOverHeads]), batch=2)
    assert _one_line(exc) == ("layer 0 (prefill): rule 'bad-mean-over-heads' score() returned shape (2, 20); "
                              "expected [B, Hkv, T] = (2, 2, 20) (nothing is broadcast; fix the rule's score())")


def test_scores_averaged_over_heads_fail_the_rule_checker():
    with pytest.raises(PluginContractError) as exc:
        check_rule(MeanOverHeads)
    assert _one_line(exc).startswith("layer 0 (prefill): rule 'bad-mean-over-heads' score() returned shape (2, 40); "
                                     "expected [B, Hkv, T] = (2, 2, 40)")


def test_scores_of_the_wrong_length_fail_in_decode_naming_the_layer(model):
    geo = geometry_of_model(model)
    plan = per_layer_plan(geo, [{}, {"decode": OpSpec(rule=OneShort.name, capacity=12)}], decode_slack=1)
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, _registry(rule=[OneShort]), prompt=12)
    assert _one_line(exc) == ("layer 1 (decode): rule 'bad-one-short' score() returned shape (1, 2, 13); "
                              "expected [B, Hkv, T] = (1, 2, 14) (nothing is broadcast; fix the rule's score())")
    with pytest.raises(PluginContractError, match=r"^layer 0 \(prefill\): rule 'bad-one-short' score\(\) returned"):
        check_rule(OneShort)


def test_nan_scores_fail_when_the_expensive_checks_are_on_and_only_then(model):
    plan = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule=NaNScores.name, capacity=8))
    registry = _registry(rule=[NaNScores])
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, registry, check=True)
    assert _one_line(exc) == ("layer 0 (prefill): rule 'bad-nan-scores' score() returned 40 NaN score(s) on stored "
                              "tokens; expected finite scores or +-inf (fix the rule's score())")
    _run(model, plan, registry, check=False)      # the switch: off, the NaN scores are not read
    with pytest.raises(PluginContractError, match="rule 'bad-nan-scores' score.. returned .* NaN"):
        check_rule(NaNScores)


def test_nan_merge_weights_fail_always(model):
    geo = geometry_of_model(model)
    plan = per_layer_plan(geo, [{"decode": OpSpec(rule=NaNMerge.name, capacity=10)}, {}], decode_slack=1)
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, _registry(rule=[NaNMerge]), prompt=10, check=False)
    assert _one_line(exc) == ("layer 0 (decode): rule 'bad-nan-merge' returned merge weights or target_scale that "
                              "are not finite (NaN or inf); expected finite weights (fix the rule's select())")


# -- quantizers ------------------------------------------------------------------------------------

def _quantized_plan(model, name):
    geo = geometry_of_model(model)
    layer = {"prefill": OpSpec(rule="key-norm", capacity=12), "k_bits": 8, "v_bits": 8, "quantizer": name}
    return per_layer_plan(geo, [{}, layer], decode_slack=1)


def test_half_width_codes_fail_at_the_first_read_and_at_prefill_with_the_expensive_checks(model):
    plan, registry = _quantized_plan(model, HalfWidth.name), _registry(quantizer=[HalfWidth])
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, registry, check=False)
    assert _one_line(exc) == ("layer 1 (decode): quantizer 'bad-half-width' (8-bit key store) dequantize() after "
                              "read returned shape (1, 2, 13, 8) torch.float32; expected (1, 2, 13, 16) torch.float32 "
                              "(fix the store's dequantize())")
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, registry, check=True)
    assert _one_line(exc).startswith("layer 1 (prefill): quantizer 'bad-half-width' (8-bit key store) dequantize() "
                                     "after fill returned shape (1, 2, 12, 8)")
    with pytest.raises(PluginContractError) as exc:
        check_quantizer(HalfWidth)
    assert _one_line(exc) == ("layer 0 (check): quantizer 'bad-half-width' (8-bit key store) dequantize() returned "
                              "((1, 2, 70, 16), torch.float32); expected (1, 2, 70, 32) torch.float32 "
                              "(fix dequantize())")


def test_predict_bytes_without_the_scales_fails_right_after_prefill(model):
    plan, registry = _quantized_plan(model, NoScales.name), _registry(quantizer=[NoScales])
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, registry, check=False)
    # 12 tokens x 2 heads x (16 code bytes + 4 scale bytes) held, 12 x 2 x 16 predicted
    assert _one_line(exc) == ("layer 1 (prefill): quantizer 'bad-no-scales' (8-bit key store) holds 480 resident bytes "
                              "for 12 tokens (1 x 2 heads, 12 rows reserved); expected 384 from its "
                              "predict_reserved_bytes / predict_bytes (count every tensor the store keeps: codes, "
                              "scales, zeros, residuals)")
    with pytest.raises(PluginContractError) as exc:
        check_quantizer(NoScales)
    assert _one_line(exc).startswith("layer 0 (check): quantizer 'bad-no-scales' (8-bit key store) holds 5040 "
                                     "resident bytes for 70 tokens (torch.float32); expected 4480 from predict_bytes")


def test_a_store_that_drops_a_token_fails_naming_the_call(model):
    plan, registry = _quantized_plan(model, DropsToken.name), _registry(quantizer=[DropsToken])
    with pytest.raises(PluginContractError) as exc:
        _run(model, plan, registry, check=False)
    assert _one_line(exc) == ("layer 1 (prefill): quantizer 'bad-drops-token' (8-bit key store) holds len(store) = 11 "
                              "tokens after fill; expected 12, the tokens the runtime stored (fix the store's fill or "
                              "__len__)")
    with pytest.raises(PluginContractError) as exc:
        check_quantizer(DropsToken)
    assert _one_line(exc) == ("layer 0 (check): quantizer 'bad-drops-token' (8-bit key store) holds len(store) = 69 "
                              "after appending 70 tokens in chunks [70]; expected 70 (fix append or __len__)")


def test_a_good_quantizer_passes_the_checker_and_the_runtime(model):
    assert check_quantizer(AbsMax8) == [("key", 8), ("value", 8)]
    session = _run(model, _quantized_plan(model, AbsMax8.name), _registry(quantizer=[AbsMax8]), check=True)
    assert session.resident_bytes().per_layer[1] > 0


# -- allocators ------------------------------------------------------------------------------------

def _allocated_plan(model, name):
    base = uniform_plan(geometry_of_model(model), prefill=OpSpec(rule="key-norm", capacity=8))
    return attrs.evolve(base, allocation=(AllocationGroup(allocator=name, layers=(0, 1)),))


def test_budgets_of_the_wrong_shape_name_the_allocator_and_its_layers(model):
    with pytest.raises(PluginContractError) as exc:
        _run(model, _allocated_plan(model, FlatBudgets.name), _registry(allocator=[FlatBudgets]))
    assert _one_line(exc) == ("layers [0, 1] (prefill): allocator 'bad-flat-budgets' returned budgets of shape () "
                              "and dtype torch.int64; expected int [2] or [2, 2] (fix the allocator's allocate())")
    with pytest.raises(PluginContractError, match=r"^layers \[0, 1, 2\] \(prefill\): allocator 'bad-flat-budgets' "
                                                  r"returned budgets of shape \(\)"):
        check_allocator(FlatBudgets)


def test_budgets_above_the_declared_bound_fail(model):
    with pytest.raises(PluginContractError) as exc:
        _run(model, _allocated_plan(model, AllOnOne.name), _registry(allocator=[AllOnOne]))
    assert _one_line(exc) == ("layer 0 (prefill): allocator 'bad-all-on-one' gave a budget of 16 tokens per head, "
                              "above its bound() of 8, which the memory model reports; fix allocate() or bound()")
    with pytest.raises(PluginContractError, match="allocator 'bad-all-on-one' gave a budget of 30 tokens per head"):
        check_allocator(AllOnOne)


# -- the switch --------------------------------------------------------------------------------------

def test_the_switch_reads_the_environment_and_apply_overrides_it(model, monkeypatch):
    from polykv.contract.rules import checks_enabled

    monkeypatch.setenv("POLYKV_CHECK", "1")
    assert checks_enabled() and checks_enabled(True) and not checks_enabled(False)
    monkeypatch.setenv("POLYKV_CHECK", "0")
    assert not checks_enabled()
    plan = uniform_plan(geometry_of_model(model))
    with polykv.apply(model, plan) as session:
        assert session.new_cache().settings.check is False
    with polykv.apply(model, plan, check=True) as session:
        assert session.new_cache().settings.check is True


# -- every built-in plugin passes the checkers -------------------------------------------------------

RULE_OPTIONS = {
    # cam wraps an inner rule and refuses ragged heads and per-head budgets (one line, naming the rule)
    "cam": {"ragged": False},
    # d2o refuses ragged heads, and its merge reads super().select() as a rectangular index, which per-head
    # budgets do not give (the selection check then refuses its indices in one line)
    "d2o": {"ragged": False},
    "kvzip": {"params": {"repeat_ids": [5, 6], "continue_ids": [7], "suffix_ids": [8], "chunk_size": 16}},  # ids for the tiny vocab
    "kvzip-head": {"model_data": None},   # (set below: the head scores of the checker's model)
    "kvzap": {"model_data": None},        # (set below: a surrogate of the checker's model's shape)
}
ALLOCATOR_PARAMS = {"cake": {"window": 4}}   # the default window (32) exceeds the checker's capacities
ALLOCATOR_OPTIONS = {"kvzip": lambda: {"rule": polykv.get_registry().rule("kvzip"),  # it ranks kvzip's own scores
                                       "rule_params": RULE_OPTIONS["kvzip"]["params"]},
                     "kvzip-head": lambda: {"rule": polykv.get_registry().rule("kvzip-head"),  # and kvzip-head's
                                            "model_data": _head_scores(3)},
                     "kvzap": lambda: {"rule": polykv.get_registry().rule("kvzap"),  # and kvzap's predictions
                                       "model_data": _surrogate(3)}}


def _surrogate(layers: int):
    """A kvzap surrogate of the contract checkers' tiny models' shape (hidden size 64, 2 KV heads), trained on nothing:
    the tokenizer its training needs does not exist there."""
    from tests.adapters.rules.test_kvzap import random_surrogate

    return {"kvzap": random_surrogate(L=layers, Hkv=2, D=64)}


def _head_scores(layers: int):
    """KVzip head scores for the contract checkers' tiny models (2 KV heads); the tokenizer they would be
    computed with does not exist there."""
    import torch

    from polykv.adapters.rules.kvzip_heads import HeadScores

    return {"kvzip-head": HeadScores(scores=torch.linspace(0.1, 0.9, 2 * layers).view(layers, 2))}


def _builtin(kind):
    registry = polykv.get_registry()
    return [e.name for e in registry.entries(kind) if e.plugin in polykv.BUILTIN_PLUGINS]


@pytest.mark.parametrize("name", [n for n in _builtin("rule") if n != "full"])
def test_every_builtin_rule_passes_check_rule(name):
    options = dict(RULE_OPTIONS.get(name, {}))
    if name == "kvzip-head":
        options["model_data"] = _head_scores(2)
    if name == "kvzap":
        options["model_data"] = _surrogate(2)
    calls = check_rule(polykv.get_registry().rule(name), **options)
    cls = polykv.get_registry().rule(name)
    assert all(calls[phase] > 0 for phase in cls.phases), calls


@pytest.mark.parametrize("name", _builtin("quantizer"))
def test_every_builtin_quantizer_passes_check_quantizer(name):
    cls = polykv.get_registry().quantizer(name)
    assert len(check_quantizer(cls)) == 2 * len(cls.bits)


@pytest.mark.parametrize("name", _builtin("allocator"))
def test_every_builtin_allocator_passes_check_allocator(name):
    options = ALLOCATOR_OPTIONS[name]() if name in ALLOCATOR_OPTIONS else {}
    alloc = check_allocator(polykv.get_registry().allocator(name), ALLOCATOR_PARAMS.get(name), **options)
    assert sorted(alloc) == [0, 1, 2]
