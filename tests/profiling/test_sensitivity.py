"""The L2 sensitivity metric: zero when nothing changes, larger under harder compression, and equal to
the same error measured independently through the real runtime and by a hand-written attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polykv.models.geometry import geometry_of_model, rope_of_model
from polykv.profiling.calibrate import calibrate
from polykv.profiling.capture import capture_sequence
from polykv.profiling.profile import CandidateConfig
from polykv.profiling.sensitivity import LayerContext, layer_l2
from polykv.profiling.validation import config_plan
from polykv.registry import get_registry
from polykv.runtime import apply

PREFIX = 64  # the prefix of the conftest's small settings


@pytest.fixture(scope="module")
def profile(model, sequences, small_settings):
    """Full MoE-nD grid of keeps and widths for three rules on two sequences."""
    settings = small_settings(rules=("streamingllm", "tova", "h2o"), keeps=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
    return calibrate(model, sequences(), settings).profile


def _ctx():
    reg = get_registry()
    return LayerContext(registry=reg, quantizer=reg.quantizer("kivi")())


def test_zero_error_when_everything_is_kept_at_16_bits(profile):
    i = next(i for i, c in enumerate(profile.configs) if c.keep == 1.0 and c.k_bits == 16 and c.v_bits == 16)
    assert np.all(profile.table("l2")[:, i] == 0.0)
    assert np.all(profile.table("l2") >= 0.0)


def test_error_grows_as_keep_falls_and_as_bits_fall(profile):
    table = profile.table("l2")
    cfgs = profile.configs
    evict = [c.rule != "full" for c in cfgs]
    by_keep = [table[:, [i for i, c in enumerate(cfgs) if evict[i] and c.keep == k]].mean()
               for k in (0.1, 0.25, 0.5, 0.75, 0.9)]
    assert all(a > b for a, b in zip(by_keep, by_keep[1:])), by_keep
    for axis in ("k_bits", "v_bits"):
        by_bits = [table[:, [i for i, c in enumerate(cfgs) if getattr(c, axis) == b]].mean() for b in (4, 8, 16)]
        assert by_bits[0] > by_bits[1] > by_bits[2], (axis, by_bits)


def _attention_input(model, layer: int) -> tuple[list, object]:
    """A forward hook recording the input of ``layer``'s o_proj: the attention output [B, q, H*d]."""
    seen = []
    attn = model.model.layers[layer].self_attn
    return seen, attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))


def _plugin_ctx():
    from tests.runtime.v2_plugins import registry_with_plugins

    reg = registry_with_plugins()
    return LayerContext(registry=reg, quantizer=reg.quantizer("kivi")())


@pytest.mark.parametrize("layer,config,third_party", [
    (1, CandidateConfig(rule="tova", keep=0.5, phase="prefill", k_bits=4, v_bits=8), False),
    (2, CandidateConfig(rule="h2o", keep=0.25, phase="prefill", k_bits=16, v_bits=4), False),
    (0, CandidateConfig(rule="streamingllm", keep=0.1, phase="prefill", k_bits=8, v_bits=16), False),
    # Rules the calibration code has never heard of: ragged heads, merges, a rule-owned state.
    (1, CandidateConfig(rule="test-headwise", keep=0.25, phase="prefill", k_bits=4, v_bits=4), True),
    (2, CandidateConfig(rule="test-merge", keep=0.25, phase="prefill", k_bits=16, v_bits=8,
                        params={"keys": True}), True),
    (0, CandidateConfig(rule="test-seen", keep=0.5, phase="prefill", k_bits=16, v_bits=16), True),
])
def test_equals_the_runtime_with_a_one_layer_plan(model, sequences, layer, config, third_party):
    """Prefill P tokens through the runtime with ``config`` on one layer, feed the follow-up tokens, and
    compare that layer's attention output with the uncompressed model's: the same relative error."""
    seqs = sequences(2)
    ctx = _plugin_ctx() if third_party else _ctx()
    ours = layer_l2(_stack([capture_sequence(model, s) for s in seqs], layer), PREFIX, [config], ctx)[0]
    errors = []
    plan = config_plan(geometry_of_model(model), layer, config)
    for s in seqs:
        ids = s.view(1, -1)
        seen, h = _attention_input(model, layer)
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
                full = seen.pop()[:, PREFIX:]
                with apply(model, plan, registry=ctx.registry) as session:
                    session.prefill(ids[:, :PREFIX])
                    seen.clear()
                    model(input_ids=ids[:, PREFIX:], use_cache=True, cache=session.cache)
                    comp = seen.pop()
        finally:
            h.remove()
        errors.append(float(torch.linalg.vector_norm(comp - full) / torch.linalg.vector_norm(full)))
    assert ours > 0
    assert ours == pytest.approx(float(np.mean(errors)), rel=1e-4, abs=1e-6)


def _stack(captures, layer):
    from polykv.profiling.capture import stack_layer

    return stack_layer(captures, layer)


def test_equals_a_hand_written_attention_for_streamingllm(model, sequences):
    """StreamingLLM keeps 4 sinks and the most recent tokens: write that attention out by hand."""
    seq = sequences(1)[0]
    cap = capture_sequence(model, seq)[1]
    keep = 0.25
    config = CandidateConfig(rule="streamingllm", keep=keep, phase="prefill")
    ours = layer_l2(cap, PREFIX, [config], _ctx())[0]

    cap_tokens = math.ceil(keep * PREFIX)
    kept = list(range(4)) + list(range(PREFIX - (cap_tokens - 4), PREFIX))
    T = cap.num_tokens
    q, k, v = cap.query[0].double(), cap.key[0].double(), cap.value[0].double()    # (H, T, d), (Hkv, T, d)
    G = q.shape[0] // k.shape[0]

    def attend(visible_prefix):
        outs = []
        for h in range(q.shape[0]):
            rows = []
            for t in range(PREFIX, T):
                cols = list(visible_prefix) + list(range(PREFIX, t + 1))
                logits = (k[h // G, cols] @ q[h, t]) * cap.scaling
                rows.append(torch.softmax(logits, dim=0) @ v[h // G, cols])
            outs.append(torch.stack(rows))
        return torch.stack(outs)                                                   # (H, F, d)

    full, comp = attend(range(PREFIX)), attend(kept)
    expected = float(torch.linalg.vector_norm(comp - full) / torch.linalg.vector_norm(full))
    assert ours == pytest.approx(expected, rel=1e-4)


def test_every_registered_rule_is_profiled_through_the_runtime(model, sequences):
    """No rule needs calibration code of its own: every registered prefill rule gets a finite error."""
    from polykv.adapters.rules.kvzip_heads import HeadScores
    from polykv.adapters.rules.query_stats import compute_query_stats
    from tests.adapters.rules.test_kvzap import random_surrogate

    reg = get_registry()
    seqs = sequences(1)
    stats = compute_query_stats(model, [s.view(1, -1) for s in seqs])
    inv_freq, rope_scaling = rope_of_model(model)
    # kvzip-head reads head scores; any [L, Hkv] table exercises its selection (tests/adapters/rules checks the scores)
    heads = HeadScores.measured(torch.rand(model.config.num_hidden_layers, model.config.num_key_value_heads,
                                           generator=torch.Generator().manual_seed(0)), model, num_tokens=1)
    ctx = LayerContext(registry=reg, quantizer=reg.quantizer("kivi")(),
                       model_data={"triattention": stats, "kvzip-head": heads, "kvzap": random_surrogate(
                           L=model.config.num_hidden_layers, Hkv=model.config.num_key_value_heads,
                           D=model.config.hidden_size)},
                       rope_inv_freq=inv_freq, rope_scaling=rope_scaling)
    cap = _stack([capture_sequence(model, s, attention_inputs=True) for s in seqs], 1)   # kvzap reads them
    rules = [n for n in reg.names("rule") if n != "full" and "prefill" in reg.rule(n).phases
             and not reg.rule(n).declares_probe()]  # a probe rule selects from a prefill (test_endtoend.py)
    configs = [CandidateConfig(rule=r, keep=0.25, phase="prefill", k_bits=4, v_bits=4) for r in rules]
    errors = layer_l2(cap, PREFIX, configs, ctx)
    assert len(rules) >= 8
    assert all(math.isfinite(e) and e > 0 for e in errors), dict(zip(rules, errors))
