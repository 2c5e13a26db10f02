"""``polykv demo``: load the default model and print its geometry (a first check that set-up worked)."""

from __future__ import annotations

import time


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="load the default model (SmolLM2-135M) and print its geometry",
                              description="Load the default model, converting its GGUF once to a cached "
                                          "copy, and print the shape facts plans depend on.")
    p.add_argument("--cache-dir", default=None, help="folder for the converted model copy "
                                                     "(default $POLYKV_CACHE/models or ~/.cache/polykv/models)")
    p.set_defaults(func=run)


def run(args) -> int:
    from polykv.geometry import geometry_of_model
    from polykv.models import cached_model_dir, default_model_path, load_default_model

    print(f"default model file: {default_model_path()}")
    start = time.perf_counter()
    model, _tokenizer = load_default_model(cache_dir=args.cache_dir)
    seconds = time.perf_counter() - start
    print(f"loaded in {seconds:.1f} s (cached copy: {cached_model_dir(args.cache_dir)})")
    geo = geometry_of_model(model)
    print(f"model type      {geo.model_type}")
    print(f"layers          {geo.num_layers}")
    print(f"query heads     {geo.num_heads}")
    print(f"KV heads        {geo.num_kv_heads}")
    print(f"head dim        {geo.head_dim}")
    print(f"RoPE theta      {geo.rope_theta:g}")
    print(f"max positions   {geo.max_positions}")
    print(f"fingerprint     {geo.fingerprint}")
    kib = geo.full_cache_bytes(4096) / 2**20
    print(f"full 16-bit KV cache at 4096 tokens: {kib:.1f} MiB")
    return 0
