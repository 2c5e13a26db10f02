"""What the end-to-end kl metric costs: sessions opened in set-up, and the forward of each (layer, config) unit.

Set-up opens one session per (rule, params) over every layer (not one per one-layer plan) and finds the same
prefill variant for each plan as capturing it alone does; a unit on layer l runs only layers l..L-1 and gives the
same log-probabilities as the whole stack.
"""

from __future__ import annotations

import pytest
import torch

from polykv.models.geometry import geometry_of_model
from polykv.profiling import endtoend as e2e
from polykv.profiling.calibrate_settings import candidate_configs
from polykv.registry import get_registry

KVZIP = {"repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10], "chunk_size": 32}
RULES = ("h2o", "tova", "snapkv", "kvzip")


@pytest.fixture(scope="module")
def menu(model, small_settings):
    settings = small_settings(rules=RULES, keeps=(0.25, 0.5, 1.0), bits=(16, 4), rule_params={"kvzip": KVZIP})
    configs = candidate_configs(RULES, settings, get_registry())
    cols = e2e.kl_columns(configs, "subset")
    geometry = geometry_of_model(model)
    plans = e2e.one_layer_plans(geometry, range(geometry.num_layers), configs, cols, quantizer=settings.quantizer,
                                quantizer_params={})
    return configs, cols, plans


def _counting_apply(monkeypatch):
    import polykv.runtime.session as session

    calls = []
    real = session.apply

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "apply", counted)
    return calls


def test_setup_opens_one_session_per_rule_not_per_plan(model, sequences, menu, prefix, monkeypatch):
    configs, cols, plans = menu
    calls = _counting_apply(monkeypatch)
    held = [s.view(1, -1)[:, :prefix] for s in sequences(2, seed=7)]
    snaps = e2e.PrefixSnapshots(model, held, plans, registry=get_registry())
    rules = {(configs[c].rule) for c in cols}                     # full, h2o, tova, snapkv, kvzip
    assert len(calls) == len(rules)
    calls.clear()
    for key in snaps.shared:
        snaps.get(key)
    # per sequence and variant: one session per (rule, params) sharing it, and the capturing session
    assert len(calls) == 2 * sum(len(snaps._plans[key]) + 1 for key in snaps.shared)
    assert len(calls) <= 2 * (len(rules) + len(snaps.shared))


def test_setup_finds_each_plans_own_prefill_variant(model, sequences, menu, prefix):
    """The variant key read from the merged session equals the one capturing the one-layer plan alone gives."""
    from polykv.runtime.fork import capture_groups

    _, _, plans = menu
    ids = sequences(1, seed=7)[0].view(1, -1)[:, :prefix]
    snaps = e2e.PrefixSnapshots(model, [ids], plans, registry=get_registry())
    seen = set()
    for layer, layer_plans in plans.items():
        for plan in layer_plans:
            alone = capture_groups(model, [plan], registry=get_registry(), input_ids=ids)
            assert list(alone) == [snaps.key(plan, layer)]
            seen.add(snaps.key(plan, layer))
    assert len(seen) == 1 + 1 + model.config.num_hidden_layers   # plain SDPA, kvzip's probe, h2o per layer


def test_attention_source_is_read_once_per_forward(model, monkeypatch):
    """Opening a session reads each attention class's source to check it dispatches through the interface; it was
    read anew on every layer of every session (5 ms a layer: minutes over a calibration's one-layer plans)."""
    import inspect

    import polykv.runtime.checks as support
    from polykv.plan import full_plan
    from polykv.runtime import apply

    support._forward_bypasses.cache_clear()
    reads = []
    real = inspect.getsource
    monkeypatch.setattr(support.inspect, "getsource", lambda obj: reads.append(obj) or real(obj))
    for _ in range(3):
        apply(model, full_plan(geometry_of_model(model)))
    assert len(reads) == 1


@pytest.mark.parametrize("rule", ["tova", "h2o", "kvzip", "full"])
def test_a_unit_runs_only_the_layers_from_its_own_and_gives_the_whole_stacks_logprobs(model, sequences, menu, prefix,
                                                                                     rule):
    """Layers below the compressed one are skipped (their forwards never run) and the log-probabilities equal the
    whole stack's bit for bit: those layers keep every token at 16 bits, as in the full plan's run."""
    configs, cols, plans = menu
    seq = sequences(1, seed=7)[0]
    snaps = e2e.PrefixSnapshots(model, [seq.view(1, -1)[:, :prefix]], plans, registry=get_registry())
    layers = model.config.num_hidden_layers
    below = e2e.LayerOutputs(model, snaps.plain()[0], seq, prefix, layers=range(layers), registry=get_registry())
    blocks = e2e.decoder_layers(model)
    col = next(c for c in cols if configs[c].rule == rule and (rule != "full" or configs[c].k_bits == 4))
    for layer in range(layers):
        plan = plans[layer][cols.index(col)]
        snap = snaps.get(snaps.key(plan, layer))[0]
        whole = e2e.followup_logprobs(model, plan, snap, seq, prefix)
        ran = []
        hooks = [b.mlp.register_forward_pre_hook(lambda _m, _a, i=i: ran.append(i)) for i, b in enumerate(blocks)]
        try:
            part = e2e.followup_logprobs(model, plan, snap, seq, prefix, layer=layer, entering=below.entering(layer))
        finally:
            for h in hooks:
                h.remove()
        assert ran == list(range(layer, layers))
        assert torch.equal(part, whole), (rule, layer, float((part - whole).abs().max()))
    assert all("forward" not in b.__dict__ for b in blocks)      # the blocks are left as they were


def test_kl_from_logits_equals_the_kl_of_log_probabilities():
    """KLReference.kl (blocks of positions, no log-softmax per plan) equals validation.kl_divergence, also for a
    plan close to the reference (a small KL is a difference of nearly equal sums) and a block boundary."""
    from polykv.profiling import validation as val

    g = torch.Generator().manual_seed(0)
    ref_logits = 3 * torch.randn(300, 97, generator=g)
    ref = torch.log_softmax(ref_logits.double(), -1)
    for scale in (1.0, 1e-3):
        logits = (ref_logits + scale * torch.randn(300, 97, generator=g)).float()
        want = val.kl_divergence(ref, torch.log_softmax(logits.double(), -1))
        got = e2e.KLReference(ref).kl(logits)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), scale
    with pytest.raises(ValueError, match="do not match"):
        e2e.KLReference(ref).kl(logits[:10])
