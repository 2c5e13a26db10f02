"""The runtime's checks and timings on CUDA, in one script with a hard time limit and one section each.

Sections (each prints ``ok``/``FAIL`` with its seconds; the script exits non-zero if any failed):

1. vanilla equality: the keep-everything 16-bit plan matches vanilla ``generate`` token for token and
   logits within 1e-4 in float32 (llama, qwen2; batch 1 and 2), and teacher-forced logits within
   bf16 rounding on the timing model in bfloat16;
2. masked reference: every rule in every phase equals a full-cache forward masked to the retained
   tokens (float32, 1e-4; bfloat16, 2% of the largest logit); signals: the prefill attention pass's
   output and column sums equal SDPA and the float32 generic path, and H2O, SnapKV + H2O, TOVA and
   D2O keep the same tokens through the pass as through the generic path (on CUDA: the pass's time
   against SDPA over one 16k layer);
3. kernel: the Triton decode kernel equals the blockwise reference (bf16 on CUDA; float32 in
   Triton's interpreter on CPU) for int2/int4/int8/16-bit key and value mixes, GQA, group ids after
   a gather and ragged heads; on CUDA also its time against bf16 SDPA over the same number of keys;
   runtime stores path: the runtime's decode straight from the stores (the fused kernel on CUDA, per
   head for ragged layers) equals the dense-view path fed the same tokens (float32 and bfloat16);
4. resident bytes: capacity + slack hold and resident bytes equal
   :func:`polykv.memory.predict_resident` (float32 mixed plan, and after every timed prefill below);
5. families: a mixed plan runs on llama, qwen2, qwen3 and mistral in bfloat16;
6. timing: prefill and decode of a random-weight ~1B Llama (TinyLlama-1.1B's shape, built from a
   config, nothing downloaded) at 16k and 32k tokens in bfloat16 for vanilla, the full plan, 8x
   eviction plans and a keep-everything K4V4 plan, printed as ratios to vanilla; a configuration that
   fails (out of memory, resident bytes off the prediction) prints a FAIL row and fails the section
   after the others ran. The GPU targets (8x plans decode >= 1.3x vanilla at 16k, the kernel within
   1.5x of bf16 SDPA) are printed as met/missed; they are measurements, not checks.

A summary table (status, seconds, section) ends the output.

The whole run stops at ``--time-limit`` seconds (default 450): sections that no longer fit are
reported as skipped, and a watchdog ends the process if one overruns.

    python bench/gpu_check.py                          # on CUDA (exits 0 with a message without one)
    python bench/gpu_check.py --device cpu --small     # everything on CPU at toy sizes (tests this script)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel section runs in Triton's interpreter on CPU

import polykv  # noqa: E402
from polykv.models.geometry import geometry_of_model  # noqa: E402
from polykv.runtime.cache import cache_keyword, output_cache  # noqa: E402
from polykv.memory import predict_resident  # noqa: E402
from polykv.plan import OpSpec  # noqa: E402
from polykv.testing import tiny_model  # noqa: E402

TOL = 1e-4
KIVI = {"group_size": 16, "residual": 16}
EVICTION_RULES = ("streamingllm", "snapkv", "h2o", "tova")
"""Rules of the 8x eviction plans (in both phases where the rule decodes, else a full decode op)."""


def _ids(batch, length, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, length), generator=g).to(device)


def check_full_plan(device, small=False) -> None:
    for family in ("llama",) if small else ("llama", "qwen2"):
        model = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16).to(device)
        geo = geometry_of_model(model)
        for batch in (1, 2):
            ids = _ids(batch, 24, batch, device)
            kw = dict(max_new_tokens=8 if small else 32, do_sample=False, output_scores=True,
                      return_dict_in_generate=True)
            with torch.no_grad():
                ref = model.generate(ids, **kw)
                with polykv.apply(model, polykv.full_plan(geo)):
                    got = model.generate(ids, **kw)
            assert torch.equal(got.sequences, ref.sequences), f"{family} batch {batch}: tokens differ"
            diff = max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores))
            assert diff < TOL, f"{family} batch {batch}: logits differ by {diff}"


def _test_module(name: str):
    """A module of tests/runtime loaded from its file (the tests are not an installed package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tests" / "runtime" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"polykv_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_masked_reference(device, small=False, dtype=torch.float32) -> str:
    """Reuses the CPU test's recorder and reference on ``device`` tensors. Float32: logits within 1e-4.
    A 16-bit dtype: within 2% of the largest logit (both sides round to the dtype; the reference
    attends eagerly in it, the runtime in SDPA or its signal pass with a float32 softmax)."""
    mod = _test_module("test_masked_reference")
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, dtype=dtype).to(device)
    geo = geometry_of_model(model)
    from polykv.adapters.rules.query_stats import compute_query_stats

    stats = compute_query_stats(model, [_ids(1, 64, 7, device)])
    worst = 0.0
    cases = [("prefill", r, 1) for r in mod.PREFILL_RULES]
    cases += [("decode", r, s) for r in mod.DECODE_RULES for s in ((4,) if small else (1, 4))]
    for phase, rule, slack in cases:
        op = OpSpec(rule=rule, capacity=12 if phase == "prefill" else 24, params=mod.PARAMS.get(rule, {}))
        plan = polykv.uniform_plan(geo, **{phase: op}, decode_slack=slack)
        ids, question = _ids(2, mod.PROMPT, 1, device), _ids(2, mod.QUESTION, 2, device)
        tokens, logits, records = mod._run_and_record(model, plan, ids, question, stats)
        records = [(None if s is None else [p.cpu() for p in s], a, b) for s, a, b, *_ in records]
        ref = _reference_on(mod, model, tokens, records, geo)
        diff = (logits.float() - ref.float()).abs().max().item()
        tol = TOL if dtype == torch.float32 else 2e-2 * max(ref.float().abs().max().item(), 1.0)
        assert diff < tol, f"{phase} {rule} slack {slack}: logits differ from the masked reference by {diff}"
        worst = max(worst, diff)
    return f"{len(cases)} cases in {str(dtype).replace('torch.', '')}, largest logit difference {worst:.2e}"


def _reference_on(mod, model, tokens, records, geo):
    device = tokens.device
    rows = torch.arange(tokens.shape[1])
    B, N = tokens.shape
    for layer in range(geo.num_layers):
        allowed = torch.zeros(B, geo.num_kv_heads, N, N, dtype=torch.bool)
        for stored, a, b in records:
            causal = (rows[a:b, None] >= rows[None, :]) & (rows[None, :] >= a)
            allowed[:, :, a:b] = causal if stored is None else causal | (rows[None, :] < a)
            if stored is not None:
                seen = torch.zeros(B, geo.num_kv_heads, N + 1, dtype=torch.bool)  # slot N: ragged padding
                seen.scatter_(-1, stored[layer].masked_fill(stored[layer] < 0, N), True)
                allowed[:, :, a:b, :a] = seen[:, :, None, :a]
        mod._MASKS[layer] = allowed.to(device)
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = mod.REF
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        model.config._attn_implementation_internal = saved
        mod._MASKS.clear()


def check_invariants(device) -> None:
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16).to(device)
    geo = geometry_of_model(model)
    layers = [{"prefill": OpSpec(rule="snapkv", capacity=40, params={"window": 8}),
               "decode": OpSpec(rule="tova", capacity=40), "k_bits": 4, "v_bits": 8, "quantizer_params": KIVI},
              {"prefill": OpSpec(rule="h2o", capacity_ratio=0.5), "decode": OpSpec(rule="h2o", capacity=30)}]
    plan = polykv.per_layer_plan(geo, layers, decode_slack=3)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        out = session.prefill(_ids(2, 96, 3, device), chunk_size=40)
        got = session.resident_bytes()
        want = predict_resident(plan, geo, 96, batch=2, dtype_bytes=4)
        assert list(got.per_layer) == [r.resident_bytes for r in want], (got.per_layer, want)
        assert [dict(m) for m in got.metadata_per_layer] == [r.metadata for r in want]
        cache, tok = session.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            seen = cache.get_seq_length()
            out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for layer, cap in zip(cache.layers, (40, 30)):
                assert layer.num_stored() <= cap + 3
                assert bool((layer.positions[..., -1] == seen).all())
                assert layer.positions.device.type == device.type


def check_families_bf16(device) -> None:
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        model = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=32, dtype=torch.bfloat16).to(device)
        geo = geometry_of_model(model)
        layers = [{"prefill": OpSpec(rule="snapkv", capacity=12, params={"window": 4}),
                   "decode": OpSpec(rule="h2o", capacity=12), "k_bits": 8, "v_bits": 4,
                   "quantizer_params": {"group_size": 32, "residual": 32}},
                  {"prefill": OpSpec(rule="streamingllm", capacity=12), "decode": OpSpec(rule="tova", capacity=12)}]
        plan = polykv.per_layer_plan(geo, layers, decode_slack=2)
        with torch.no_grad(), polykv.apply(model, plan) as session:
            out = model.generate(_ids(2, 32, 5, device), max_new_tokens=12, do_sample=False)
            assert out.shape == (2, 44), f"{family}: generated shape {tuple(out.shape)}"
            assert all(n <= 14 for n in session.cache.stored_tokens()), f"{family}: capacity exceeded"



# -- signals from the attention pass ---------------------------------------------------------------

SIGNAL_PLANS = {
    "h2o": {"prefill": OpSpec(rule="h2o", capacity=14), "decode": OpSpec(rule="h2o", capacity=14)},
    "snapkv+h2o": {"prefill": OpSpec(rule="snapkv", capacity=14, params={"window": 4, "kernel_size": 3}),
                   "decode": OpSpec(rule="h2o", capacity=14)},
    "tova": {"prefill": OpSpec(rule="tova", capacity=14), "decode": OpSpec(rule="tova", capacity=14)},
    "d2o": {"prefill": OpSpec(rule="d2o", capacity=14, params={"n_sink": 2})},
}


def check_signals(device, small) -> str:
    """The prefill pass's output and signals in the timing dtype against SDPA and the float32 generic
    path, and the same selections through the pass as through the generic path (float32 tiny model);
    on CUDA also the pass's time against SDPA over one layer of the timing model's shape."""
    from polykv.contract.state import SignalRequest, attention_column_sums, attention_last_rows
    from polykv.attention import kernels as attention
    from polykv.attention import attach as attention_function   # where the prefill pass looks signal_request up
    from polykv.attention.signals import attention_with_signals

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    B, H, Hkv, d = (1, 8, 2, 32) if small else (1, 32, 4, 64)
    T = 300 if small else 4096
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, n, T, d, generator=g).to(device, dtype) for n in (H, Hkv, Hkv))
    request = SignalRequest(column_sums=True, column_sums_per_head=True, last_rows=32)
    out, sig = attention_with_signals(q, k, v, d ** -0.5, request)
    ref = attention.sdpa(q, k, v, d ** -0.5)
    diff = (out.float() - ref.float()).abs().max().item()
    assert diff < tol, f"signal pass output differs from SDPA by {diff}"
    sums = attention_column_sums(q.float(), k.float(), d ** -0.5)
    rel = ((sig.column_sums - sums).abs().max() / sums.abs().max()).item()
    assert rel < tol, f"column sums differ from the float32 generic path by {rel:.2e} of their largest"
    per_head = sig.column_sums_per_head.view(B, Hkv, H // Hkv, T).sum(2)
    assert (per_head - sig.column_sums).abs().max().item() <= 1e-4 * sums.abs().max().item()
    rows = attention_last_rows(q.float(), k.float(), d ** -0.5, 32)
    assert (sig.last_rows - rows).abs().max().item() < tol, "last rows differ from the generic path"
    notes = [f"{str(dtype).replace('torch.', '')} output {diff:.1e}, column sums {rel:.1e} relative"]

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16).to(device)
    geo = geometry_of_model(model)
    ids = _ids(2, 45, 6, device)
    for name, ops in SIGNAL_PLANS.items():
        plan = polykv.uniform_plan(geo, decode_slack=2, **ops)
        kept = []
        for generic in (False, True):
            saved = attention_function.signal_request
            if generic:  # states compute their own signals (the path third-party states take)
                attention_function.signal_request = lambda states: SignalRequest()
            try:
                with torch.no_grad(), polykv.apply(model, plan, seed=3) as session:
                    session.prefill(ids, chunk_size=16)
                    kept.append([layer.positions.clone() for layer in session.cache.layers])
            finally:
                attention_function.signal_request = saved
        assert all(torch.equal(a, b) for a, b in zip(*kept)), f"{name}: the pass selected other tokens"
    notes.append(f"selections equal for {', '.join(SIGNAL_PLANS)}")
    if device.type == "cuda":
        T = 16384
        q, k, v = (torch.randn(1, n, T, 64, device=device, dtype=dtype) for n in (32, 4, 4))
        col = SignalRequest(column_sums=True)
        fused = _cuda_ms(lambda: attention_with_signals(q, k, v, 0.125, col), reps=3)
        plain = _cuda_ms(lambda: attention.sdpa(q, k, v, 0.125), reps=3)
        notes.append(f"one layer at {T}: pass {fused:.1f} ms, SDPA {plain:.1f} ms ({fused / plain:.1f}x)")
    return "; ".join(notes)


def check_stores_path(device, small) -> str:
    """The runtime's decode straight from the stores (on CUDA: the fused kernel for uniform quantized
    layers; per head for ragged ones) against the dense-view path (``read_stores = False``), fed the
    same tokens: logits within the dtype's rounding, float32 and bfloat16, uniform K4V4 / K2V8 / K16V4
    and a ragged plan at 4 bits."""
    registry = _test_module("v2_plugins").registry_with_plugins()      # a head-wise test rule: ragged heads
    steps = 6 if small else 24
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("llama", layers=2, heads=6, kv_heads=2, head_dim=32, dtype=dtype).to(device)
        geo = geometry_of_model(model)
        qp = {"group_size": 8, "residual": 16}
        plans = {f"k{k}v{v}": polykv.uniform_plan(geo, k_bits=k, v_bits=v, quantizer_params=qp)
                 for k, v in ((4, 4), (2, 8), (16, 4))}
        plans["ragged-k4v4"] = polykv.uniform_plan(geo, prefill=OpSpec(rule="test-headwise", capacity=12), k_bits=4,
                                                   v_bits=4, quantizer_params=qp)
        ids = _ids(2, 40, 3, device)
        for name, plan in plans.items():
            runs, tokens = [], None
            for stores in (False, True):  # the view path picks the tokens; the stores path is fed the same ones
                with torch.no_grad(), polykv.apply(model, plan, registry=registry) as session:
                    out = session.prefill(ids)
                    for layer in session.cache.layers:
                        layer.read_stores = stores
                    fed = [out.logits[:, -1:].argmax(-1)] if tokens is None else tokens
                    logits = []
                    for i in range(steps):
                        out = model(fed[i], **{cache_keyword(model): session.cache}, use_cache=True)
                        logits.append(out.logits[:, -1].float())
                        if tokens is None:
                            fed.append(out.logits[:, -1:].argmax(-1))
                    tokens = fed
                runs.append(torch.stack(logits))
            diff = (runs[0] - runs[1]).abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 3e-2 * max(runs[1].abs().max().item(), 1.0)
            assert diff < tol, f"{name} {dtype}: the stores path differs from the view path by {diff}"
            key = str(dtype).replace("torch.", "")
            worst[key] = max(worst.get(key, 0.0), diff)
    return "largest logit difference " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())


def _cuda_ms(fn, reps=50) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


# -- kernel ------------------------------------------------------------------------------------------

def _stores(T, k_bits, v_bits, *, B, Hkv, d, dtype, device, group_size, seed=0):
    from polykv.adapters.quantizers.kivi import KiviQuantizer

    quant = KiviQuantizer(group_size=group_size, residual=2 * group_size)
    g = torch.Generator().manual_seed(seed)
    ks = quant.new_store("key", k_bits, dtype=dtype, device=device)
    vs = quant.new_store("value", v_bits, dtype=dtype, device=device)
    for a in range(0, T, 4096):
        n = min(4096, T - a)
        ks.append(torch.randn(B, Hkv, n, d, generator=g).to(device, dtype))
        vs.append(torch.randn(B, Hkv, n, d, generator=g).to(device, dtype))
    return ks, vs


def _ragged(stream, lengths):
    """The stream with per-head lengths: each head keeps a prefix; its padding residual rows become nan."""
    import attrs

    from polykv.storage.token_blocks import with_head_counts

    nq = lengths.clamp(max=stream.num_quantized)
    nr = lengths - nq
    res = stream.residual.clone()
    rows = torch.arange(res.shape[2], device=res.device)
    res[rows.view(1, 1, -1) >= nr.unsqueeze(-1)] = float("nan")
    return with_head_counts(attrs.evolve(stream, residual=res), nq, nr)


def check_kernel(device, small) -> str:
    from polykv.adapters.quantizers import kivi_triton
    from polykv.attention.online_softmax import blockwise_attention, token_blocks

    if device.type != "cuda" and not kivi_triton.interpreting():
        raise RuntimeError("on CPU the kernel needs TRITON_INTERPRET=1 before Triton is imported")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    B, H, Hkv, d = (1, 8, 2, 32) if small else (1, 32, 4, 64)
    contexts = (80,) if small else (16384, 32768)
    lines = []
    for T in contexts:
        for kb, vb in ((2, 2), (4, 4), (8, 4), (4, 16), (16, 16)):
            ks, vs = _stores(T, kb, vb, B=B, Hkv=Hkv, d=d, dtype=dtype, device=device, group_size=16 if small else 32)
            for q_len in (1, 2):
                q = torch.randn(B, H, q_len, d, generator=torch.Generator().manual_seed(T + q_len)).to(device, dtype)
                kv, vv = token_blocks(ks), token_blocks(vs)
                got = kivi_triton.decode_attention(q, kv, vv, scaling=d ** -0.5)
                want = blockwise_attention(q, kv, vv, scaling=d ** -0.5)
                diff = (got.float() - want.float()).abs().max().item()
                assert diff < tol, f"K{kb}V{vb} T={T} q={q_len}: kernel differs from the reference by {diff}"
            lengths = torch.randint(T // 2, T + 1, (B, Hkv), generator=torch.Generator().manual_seed(1)).to(device)
            kr, vr = _ragged(token_blocks(ks), lengths), _ragged(token_blocks(vs), lengths)
            got = kivi_triton.decode_attention(q[:, :, :1], kr, vr, scaling=d ** -0.5)
            want = blockwise_attention(q[:, :, :1], kr, vr, scaling=d ** -0.5)
            diff = (got.float() - want.float()).abs().max().item()
            assert bool(torch.isfinite(got).all()) and diff < tol, f"K{kb}V{vb} ragged: differs by {diff}"
            idx = torch.sort(torch.randperm(T, generator=torch.Generator().manual_seed(2))[: T // 2]).values
            ks.gather(idx.to(device).expand(B, Hkv, -1))
            vs.gather(idx.to(device).expand(B, Hkv, -1))
            kv, vv = token_blocks(ks), token_blocks(vs)
            diff = (kivi_triton.decode_attention(q[:, :, :1], kv, vv, scaling=d ** -0.5).float()
                    - blockwise_attention(q[:, :, :1], kv, vv, scaling=d ** -0.5).float()).abs().max().item()
            assert diff < tol, f"K{kb}V{vb} after a gather: differs by {diff}"
        if device.type == "cuda":
            lines.append(_kernel_timing(kivi_triton, T, B, H, Hkv, d, dtype, device))
    return "; ".join(lines)


def _kernel_timing(kivi_triton, T, B, H, Hkv, d, dtype, device) -> str:
    import torch.nn.functional as F

    from polykv.attention.online_softmax import token_blocks

    ks, vs = _stores(T, 4, 4, B=B, Hkv=Hkv, d=d, dtype=dtype, device=device, group_size=32)
    kv, vv = token_blocks(ks), token_blocks(vs)
    K, V = ks.dequantize(), vs.dequantize()
    q = torch.randn(B, H, 1, d, device=device, dtype=dtype)
    qf = q.view(B, Hkv, H // Hkv, d)

    def best(fn, reps=50):
        fn()
        torch.cuda.synchronize(device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(stop) / reps

    kernel = best(lambda: kivi_triton.decode_attention(q, kv, vv, scaling=d ** -0.5))
    sdpa = best(lambda: F.scaled_dot_product_attention(qf, K, V, scale=d ** -0.5))
    deq = best(lambda: F.scaled_dot_product_attention(qf, ks.dequantize(), vs.dequantize(), scale=d ** -0.5))
    verdict = "met" if kernel <= KERNEL_TARGET * sdpa else "missed"
    return (f"{T} tokens K4V4: kernel {kernel:.3f} ms, bf16 SDPA {sdpa:.3f} ms ({kernel / sdpa:.2f}x, target "
            f"<= {KERNEL_TARGET}x {verdict}), dequantize+SDPA {deq:.3f} ms")


# -- timing ------------------------------------------------------------------------------------------

_MODELS: dict = {}


def timing_model(device, small):
    """TinyLlama-1.1B's shape with random weights (``small``: a toy Llama), in bfloat16; built once."""
    key = (str(device), small)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = _build_timing_model(device, small)
    return _MODELS[key]


def _build_timing_model(device, small):
    import transformers

    dtype = torch.bfloat16
    if small:
        return tiny_model("llama", layers=2, heads=8, kv_heads=2, head_dim=32, vocab=512, dtype=dtype).to(device)
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=40960, rope_theta=10000.0,
        tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def timing_plans(geo, context):
    plans = [("full", polykv.full_plan(geo))]
    registry = polykv.get_registry()
    for rule in EVICTION_RULES:
        op = OpSpec(rule=rule, capacity=context // 8)
        decode = op if "decode" in registry.rule(rule).phases else None
        plans.append((f"{rule}@8x", polykv.uniform_plan(geo, prefill=op, decode=decode, decode_slack=16)))
    k4v4 = [{"prefill": OpSpec(rule="full"), "decode": OpSpec(rule="full"), "k_bits": 4, "v_bits": 4,
             "quantizer_params": {"group_size": 32, "residual": 32}}] * geo.num_layers
    plans.append(("K4V4", polykv.per_layer_plan(geo, k4v4, decode_slack=16)))
    return plans


def time_one(model, ids, steps, plan, geo):
    """Prefill seconds, decode tokens/s, peak bytes; for a plan, checks resident bytes after prefill."""
    device = ids.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.no_grad():
        session = None if plan is None else polykv.apply(model, plan).__enter__()
        try:
            sync()
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1) if plan is None else session.prefill(ids, logits_to_keep=1)
            sync()
            prefill = time.perf_counter() - t0
            cache = output_cache(out) if plan is None else session.cache
            if plan is not None:
                got = list(session.resident_bytes().per_layer)
                nbytes = torch.finfo(model.dtype).bits // 8
                want = [r.resident_bytes for r in predict_resident(plan, geo, ids.shape[1], dtype_bytes=nbytes)]
                assert got == want, f"resident bytes after prefill {sum(got)} != predicted {sum(want)}"
            tok = out.logits[:, -1:].argmax(-1)
            del out
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            sync()
            decode = steps / (time.perf_counter() - t0)
        finally:
            if session is not None:
                session.__exit__(None, None, None)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return prefill, decode, peak


DECODE_TARGET, KERNEL_TARGET = 1.3, 1.5
"""On a GPU: 8x plans decode >= 1.3x vanilla tok/s at 16k; the kernel within 1.5x of bf16 SDPA decode."""


def run_timing(device, small, deadline) -> str:
    """Times every configuration; one that fails (out of memory, a resident-bytes mismatch) prints a
    FAIL row and the section fails after the others ran."""
    model = timing_model(device, small)
    geo = geometry_of_model(model)
    contexts, steps = ((256, 512), 4) if small else ((16384, 32768), 32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    time_one(model, torch.randint(1, vocab, (1, 64), generator=g).to(device), 2, None, geo)  # warm-up
    print(f"    {'config':<16}{'ctx':>7}{'prefill s':>10}{'x van':>7}{'dec tok/s':>10}{'x van':>7}{'peak GiB':>9}")
    skipped, failures, decode_ratio = 0, [], {}
    for context in contexts:
        ids = torch.randint(1, vocab, (1, context), generator=g).to(device)
        base = None
        for name, plan in [("vanilla", None)] + timing_plans(geo, context):
            if time.monotonic() > deadline:
                skipped += 1
                print(f"    {name:<16}{context:>7}  skipped: time limit")
                continue
            try:
                prefill, decode, peak = time_one(model, ids, steps, plan, geo)
            except Exception as exc:  # report the row, keep timing the others
                failures.append(f"{name}@{context}")
                print(f"    {name:<16}{context:>7}  FAIL {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if name == "vanilla":
                base = (prefill, decode)
            if base is None:
                print(f"    {name:<16}{context:>7}{prefill:>10.3f}{'n/a':>7}{decode:>10.1f}{'n/a':>7}", flush=True)
                continue
            decode_ratio[(name, context)] = decode / base[1]
            print(f"    {name:<16}{context:>7}{prefill:>10.3f}{prefill / base[0]:>7.2f}{decode:>10.1f}"
                  f"{decode / base[1]:>7.2f}{'n/a' if peak is None else f'{peak / 2 ** 30:.2f}':>9}", flush=True)
    if device.type == "cuda" and not small:
        first = contexts[0]
        for rule in EVICTION_RULES:
            got = decode_ratio.get((f"{rule}@8x", first))
            verdict = "n/a" if got is None else ("met" if got >= DECODE_TARGET else "missed")
            print(f"    target {rule}@8x decode >= {DECODE_TARGET}x vanilla at {first}: "
                  f"{'n/a' if got is None else f'{got:.2f}x'} {verdict}")
    if failures:
        raise RuntimeError(f"configuration(s) failed: {', '.join(failures)}")
    return f"{skipped} configuration(s) skipped for time" if skipped else ""


def check_bf16_vanilla(device, small) -> str:
    """The full plan in the timing model's dtype: teacher-forced logits against vanilla."""
    model = timing_model(device, small)
    geo = geometry_of_model(model)
    T, steps = (64, 8) if small else (512, 16)
    ids = torch.randint(1, model.config.vocab_size, (1, T + steps), generator=torch.Generator().manual_seed(3))
    ids = ids.to(device)
    logits = []
    for plan in (None, polykv.full_plan(geo)):
        with torch.no_grad():
            session = None if plan is None else polykv.apply(model, plan).__enter__()
            try:
                cache = None if plan is None else session.new_cache()
                out = model(ids[:, :T], **{cache_keyword(model): cache}, use_cache=True)
                cache, rows = output_cache(out), [out.logits[:, -1]]
                for i in range(T, T + steps):
                    out = model(ids[:, i:i + 1], **{cache_keyword(model): cache}, use_cache=True)
                    rows.append(out.logits[:, -1])
            finally:
                if session is not None:
                    session.__exit__(None, None, None)
        logits.append(torch.stack(rows).float())
    diff = (logits[0] - logits[1]).abs().max().item()
    scale = logits[0].abs().max().item()
    same = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    assert diff <= 2e-2 * max(scale, 1.0), f"{model.dtype} logits differ by {diff} (max |logit| {scale:.2f})"
    return f"{model.dtype}: max |logit diff| {diff:.2e} of max |logit| {scale:.2f}, argmax agree {same:.0%}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="runtime checks and timings on CUDA")
    ap.add_argument("--device", default="cuda", help="device to check (cpu runs everything, to test this script)")
    ap.add_argument("--small", action="store_true", help="toy model and short contexts (minutes become seconds)")
    ap.add_argument("--time-limit", type=float, default=450.0, help="hard limit for the whole run, seconds")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check (exit 0). "
              "Run it on a machine with an NVIDIA GPU, or with --device cpu --small.")
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.time_limit
    watchdog = threading.Timer(args.time_limit + 30, _overrun)
    watchdog.daemon = True
    watchdog.start()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check on {name}, torch {torch.__version__}, {'small' if args.small else 'full'} sizes, "
          f"time limit {args.time_limit:.0f} s")
    sections = [
        ("1 vanilla equality (float32)", lambda: check_full_plan(device, args.small)),
        ("1 vanilla equality (timing dtype)", lambda: check_bf16_vanilla(device, args.small)),
        ("2 masked reference, every rule and phase (float32)", lambda: check_masked_reference(device, args.small)),
        ("2 masked reference, every rule and phase (bfloat16)",
         lambda: check_masked_reference(device, args.small, torch.bfloat16)),
        ("2 signals from the attention pass", lambda: check_signals(device, args.small)),
        ("3 kernel vs blockwise reference", lambda: check_kernel(device, args.small)),
        ("3 runtime decode from the stores vs the dense view", lambda: check_stores_path(device, args.small)),
        ("4 resident bytes and invariants", lambda: check_invariants(device)),
        ("5 model families in bfloat16", lambda: check_families_bf16(device)),
        ("6 timing: vanilla, full, 8x eviction, K4V4", lambda: run_timing(device, args.small, deadline)),
    ]
    failed = skipped = 0
    summary = []
    for title, fn in sections:
        print(f"== {title}", flush=True)
        if time.monotonic() > deadline:
            skipped += 1
            print("   SKIP  time limit reached")
            summary.append((title, "SKIP", 0.0))
            continue
        t0 = time.perf_counter()
        try:
            note = fn()
            print(f"   ok    ({time.perf_counter() - t0:.1f} s){' ' + note if note else ''}", flush=True)
            summary.append((title, "ok", time.perf_counter() - t0))
        except Exception as exc:  # report every section, then fail
            failed += 1
            print(f"   FAIL  {type(exc).__name__}: {exc}", flush=True)
            summary.append((title, "FAIL", time.perf_counter() - t0))
    watchdog.cancel()
    total = time.monotonic() - t_start
    print("summary:")
    for title, status, seconds in summary:
        print(f"  {status:<5}{seconds:>7.1f} s  {title}")
    verdict = "all checks passed" if not (failed or skipped) else f"{failed} failed, {skipped} skipped"
    print(f"gpu_check: {verdict} in {total:.0f} s")
    return 1 if failed or skipped else 0


def _overrun() -> None:
    print("gpu_check: FAIL  hard time limit exceeded; stopping", flush=True)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
