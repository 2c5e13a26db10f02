"""The runtime's core checks on CUDA: the same code that runs on CPU must run unchanged on a GPU.

Checks, on tiny random Llama and Qwen2 models moved to ``cuda`` in float32 (and a bf16 smoke run):

1. the keep-everything 16-bit plan matches vanilla ``generate`` token for token and logits within 1e-4
   (prefill and 32 decode steps), batch 1 and 2;
2. every rule in every phase equals a full-cache forward masked to the retained tokens (1e-4);
3. capacity + slack holds, new positions equal tokens seen, and resident bytes equal
   :func:`polykv.memory.predict_resident` for a quantized mixed plan;
4. a mixed plan runs on llama, qwen2, qwen3 and mistral in bfloat16.

Exits 0 with a message when CUDA is not available; non-zero when a check fails.

    python bench/gpu_check.py                 # on CUDA
    python bench/gpu_check.py --device cpu    # the same checks on CPU (tests this script)
"""

from __future__ import annotations

import sys
import time

import torch

import polykv
from polykv.geometry import geometry_of_model
from polykv.memory import predict_resident
from polykv.plan import OpSpec
from polykv.testing import tiny_model

TOL = 1e-4
KIVI = {"group_size": 16, "residual": 16}


def _ids(batch, length, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, length), generator=g).to(device)


def check_full_plan(device) -> None:
    for family in ("llama", "qwen2"):
        model = tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=16).to(device)
        geo = geometry_of_model(model)
        for batch in (1, 2):
            ids = _ids(batch, 24, batch, device)
            kw = dict(max_new_tokens=32, do_sample=False, output_scores=True, return_dict_in_generate=True)
            with torch.no_grad():
                ref = model.generate(ids, **kw)
                with polykv.apply(model, polykv.full_plan(geo)):
                    got = model.generate(ids, **kw)
            assert torch.equal(got.sequences, ref.sequences), f"{family} batch {batch}: tokens differ"
            diff = max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores))
            assert diff < TOL, f"{family} batch {batch}: logits differ by {diff}"


def check_masked_reference(device) -> None:
    """Reuses the CPU test's recorder and reference on CUDA tensors."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tests" / "runtime" / "test_masked_reference.py"
    spec = importlib.util.spec_from_file_location("polykv_masked_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16).to(device)
    geo = geometry_of_model(model)
    from polykv.profiling.query_stats import compute_query_stats

    stats = compute_query_stats(model, [_ids(1, 64, 7, device)])
    cases = [("prefill", r, 1) for r in mod.PREFILL_RULES]
    cases += [("decode", r, s) for r in mod.DECODE_RULES for s in (1, 4)]
    for phase, rule, slack in cases:
        op = OpSpec(rule=rule, capacity=12 if phase == "prefill" else 24, params=mod.PARAMS.get(rule, {}))
        plan = polykv.uniform_plan(geo, **{phase: op}, decode_slack=slack)
        ids, question = _ids(2, mod.PROMPT, 1, device), _ids(2, mod.QUESTION, 2, device)
        tokens, logits, records = mod._run_and_record(model, plan, ids, question, stats)
        records = [(None if s is None else [p.cpu() for p in s], a, b) for s, a, b in records]
        ref = _reference_on(mod, model, tokens, records, geo)
        diff = (logits - ref).abs().max().item()
        assert diff < TOL, f"{phase} {rule} slack {slack}: logits differ from the masked reference by {diff}"


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
                seen = torch.zeros(B, geo.num_kv_heads, N, dtype=torch.bool)
                seen.scatter_(-1, stored[layer], True)
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
            out = model(tok, past_key_values=cache, use_cache=True)
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


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="runtime core checks on CUDA")
    ap.add_argument("--device", default="cuda", help="device to check (cpu runs the same checks, to test this script)")
    device = torch.device(ap.parse_args(argv).device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check (exit 0). "
              "Run it on a machine with an NVIDIA GPU.")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check on {name}, torch {torch.__version__}")
    failed = 0
    for check in (check_full_plan, check_masked_reference, check_invariants, check_families_bf16):
        t0 = time.perf_counter()
        try:
            check(device)
            print(f"  ok    {check.__name__} ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # report every check, then fail
            failed += 1
            print(f"  FAIL  {check.__name__}: {type(exc).__name__}: {exc}")
    print("gpu_check: all checks passed" if not failed else f"gpu_check: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
