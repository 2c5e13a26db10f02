"""Tiny random-weight decoder models for tests and examples (built from a config, no download)."""

from __future__ import annotations

import torch


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
