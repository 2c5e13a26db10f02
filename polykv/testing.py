"""Tiny random-weight decoder models for tests and examples (built from a config, no download), the full plan's
vanilla-equality checks and decode soaks. The plugin contract checks are :mod:`polykv.plugin_checks`."""

from __future__ import annotations

import importlib
import warnings

import torch

from polykv.attention.signals import signal_request
from polykv.memory import predict_resident
from polykv.models.geometry import geometry_of_model


def tiny_model(family: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               vocab: int = 128, seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised ``family`` ("llama", "qwen2", "qwen3", "mistral") causal LM in eval mode."""
    import transformers

    configs = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    if family not in configs:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(configs)}")
    kwargs = dict(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                  vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = configs[family](**kwargs)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    # Random weights emit the config's EOS id by chance; tests want fixed-length generations.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_model(config, *, attn_implementation: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised causal LM of any transformers ``config`` in eval mode, for fixed-length generations."""
    import transformers

    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def token_ids(batch: int, length: int, *, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """[batch, length] random token ids in [1, vocab) (id 0 is the tiny models' pad token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g)


def decode_soak(model, plan, *, context_tokens: int, steps: int, model_data=None, seed: int = 0,
                through_model: bool = False):
    """Prefill ``context_tokens`` tokens under ``plan``, decode ``steps`` tokens one forward at a time, and
    compare the store bytes measured after every forward with the decode bound of
    :func:`polykv.memory.predict_resident` (``phase="decode"``, ``new_tokens=steps``).

    By default the plan's cache is driven directly with random post-RoPE keys, values and queries (the
    attention and eviction path of the runtime, without the model's other layers: thousands of steps
    in seconds); ``through_model=True`` runs the model's forward on random token ids instead.

    Returns ``(worst_measured, bound, forwards_over)``: per layer, the largest K+V store bytes measured,
    the predicted bound, and how many forwards ended above it.
    """
    import polykv

    geo = geometry_of_model(model)
    elem = next(model.parameters()).element_size()
    rows = predict_resident(plan, geo, context_tokens, dtype_bytes=elem, phase="decode", new_tokens=steps)
    bound = [r.resident_bytes for r in rows]
    worst, over = [0] * len(bound), [0] * len(bound)
    gen = torch.Generator().manual_seed(seed)

    def measure(session):
        for i, b in enumerate(session.resident_bytes().per_layer):
            worst[i] = max(worst[i], b)
            over[i] += b > bound[i]

    with torch.no_grad(), polykv.apply(model, plan, model_data=model_data) as session:
        if through_model:
            ids = torch.randint(1, model.config.vocab_size, (1, context_tokens + steps), generator=gen)
            session.prefill(ids[:, :context_tokens])
            for t in range(context_tokens, context_tokens + steps):
                model(ids[:, t:t + 1], use_cache=True, **{session.cache_keyword: session.cache})
                measure(session)
            return worst, bound, over
        cache = session.new_cache()
        dtype = next(model.parameters()).dtype
        for q in [context_tokens] + [1] * steps:
            feed_random(cache, geo, q, gen, dtype)
            if q == 1:
                measure(session)
    return worst, bound, over


def full_plan_against_vanilla(model, geometry, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Run ``prompt`` [B, T] through vanilla transformers and through the keep-everything plan: a prefill
    forward and ``new_tokens`` greedy ``generate`` steps each. Returns ``prefill_diff`` (max |logit
    difference| of the prefill), ``same_tokens`` (generated sequences equal), ``score_diff`` (max |logit
    difference| over the generated steps) and the plan cache's ``stored_tokens()`` after the prefill
    (``stored_after_prefill``) and after generating (``stored_after_generate``)."""
    import polykv

    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref_prefill = model(prompt).logits
        ref = model.generate(prompt, **kwargs)
        with polykv.apply(model, polykv.full_plan(geometry)) as session:
            got_prefill = model(prompt, use_cache=True, **{session.cache_keyword: session.new_cache()}).logits
            after_prefill = session.cache.stored_tokens()
            got = model.generate(prompt, **kwargs)
            after_generate = session.cache.stored_tokens()
    return {"prefill_diff": (got_prefill - ref_prefill).abs().max().item(),
            "same_tokens": torch.equal(got.sequences, ref.sequences),
            "score_diff": max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores)),
            "stored_after_prefill": after_prefill, "stored_after_generate": after_generate}


def chunked_prefill_against_vanilla(model, geometry, prompt: torch.Tensor, split: int, chunk_size: int,
                                    ) -> tuple[float, float]:
    """Prefill ``prompt[:, :split]`` in chunks of ``chunk_size`` under the keep-everything plan, then feed the
    rest in one multi-token forward. Returns the max |logit difference| against one vanilla forward over the
    whole prompt for the last prefill chunk and for the continuation."""
    import polykv

    with torch.no_grad():
        ref = model(prompt).logits
        with polykv.apply(model, polykv.full_plan(geometry)) as session:
            out = session.prefill(prompt[:, :split], chunk_size=chunk_size).logits
            more = model(prompt[:, split:], use_cache=True, **{session.cache_keyword: session.cache}).logits
    return ((out - ref[:, split - out.shape[1]:split]).abs().max().item(),
            (more - ref[:, split:]).abs().max().item())


def feed_random(cache, geo, q: int, gen: torch.Generator, dtype: torch.dtype, batch: int = 1,
                hidden_size: int | None = None) -> None:
    """One forward of ``q`` tokens through every layer of a plan ``cache``, without the model: random post-RoPE
    keys, values [batch, Hkv, q, d] and queries [batch, H, q, d] through the attention and eviction path, and
    random attention inputs [batch, q, hidden_size] (default H x d) for the layers whose states read them."""
    H, Hkv, d, B = geo.num_heads, geo.num_kv_heads, geo.head_dim, batch
    for i, layer in enumerate(cache.layers):
        k, v = (torch.randn(B, Hkv, q, d, generator=gen).to(dtype) for _ in range(2))
        step = cache.begin(k, v, i)
        if signal_request(step.states).attention_input:   # what the session's pre-hook would have kept
            layer.settings.attention_inputs[i] = torch.randn(B, q, hidden_size or H * d, generator=gen).to(dtype)
        layer.after_attention(step, torch.randn(B, H, q, d, generator=gen).to(dtype), d ** -0.5)


# The contract checkers for plugin authors (check_rule, check_quantizer, check_allocator) live in
# polykv.plugin_checks, which builds its models here.
_MOVED = ("check_rule", "check_quantizer", "check_allocator")


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'polykv.testing' has no attribute {name!r}")
    warnings.warn(f"polykv.testing.{name} moved to polykv.plugin_checks in 0.2; import it from there (it goes from "
                  f"polykv.testing in 0.3)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("polykv.plugin_checks"), name)
