"""Per-model data a retention rule needs, declared by the rule itself.

Some rules score keys with data measured once per model (TriAttention: pre-RoPE query statistics per
layer and query head). Such a rule class sets the class attribute ``model_data_need`` to a
:class:`ModelDataNeed`: the key it reads from ``ctx.model_data``, how to compute the data over plain
token batches, how to load a saved copy (the data object saves itself with ``data.save(path)``), an
optional check that a loaded copy belongs to the model, and the side file beside a profile where
calibration saves it (``x.profile.json`` -> ``x`` + ``suffix``).

Calibration, studies and :func:`polykv.profiling.calibrate.model_data_for` ask the registry for the
needs of the rules they run (:func:`needs_of_rules`, :func:`registered_needs`), so no core module names
a rule. Users keep passing ``model_data={key: data}`` to :func:`polykv.apply` directly.

What a rule's data type needs of the core to measure, save and check itself: :func:`model_geometry` (the
model's layers, heads and fingerprint), :func:`fingerprints_match`, :func:`read_tagged` and
:func:`check_tensors` (a safetensors file with a format tag, refused in one line when foreign or damaged)
and :func:`write_atomically` (a temp file renamed over the path).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import attrs

from polykv.atomic import replace_with
from polykv.errors import CacheWriteWarning, PolykvError, RuntimeConfigError
from polykv.models.geometry import fingerprints_match, geometry_of_model
from polykv.models.tagged_tensors import check_tensors, read_tagged

model_geometry = geometry_of_model
"""``model_geometry(model)``: the model's shape (``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``) and
``fingerprint``, which a data file records so that data measured on another model is refused."""
write_atomically = replace_with
"""``write_atomically(path, write)``: ``write(tmp)`` fills a temp file that is then renamed over ``path``."""


class ModelDataError(RuntimeConfigError):
    """Per-model data a plan's rules need is missing or belongs to another model."""


NEED_ATTRIBUTE = "model_data_need"
"""The rule class attribute that holds a :class:`ModelDataNeed` (absent or None: the rule needs nothing)."""


@attrs.define(frozen=True, kw_only=True)
class ModelDataNeed:
    """What a rule needs measured on the model, and where that lives beside a profile."""

    key: str
    """Key of ``ctx.model_data`` (and of ``model_data=`` in :func:`polykv.apply`) the rule reads."""
    suffix: str
    """Side-file suffix: a profile ``x.profile.json`` keeps the data in ``x`` + suffix."""
    compute: Callable[[Any, list], Any]
    """``compute(model, token_batches)`` -> the data (token batches: LongTensor [1, T] of plain text)."""
    load: Callable[[str], Any]
    """``load(path)`` -> the data saved there with ``data.save(path)``."""
    check: Callable[[Any, Any], None] | None = None
    """``check(data, model)`` raises when loaded data was measured on another model."""
    recognise: Callable[[str], bool] | None = None
    """``recognise(path)``: True when the file at ``path`` is this data as polykv writes it (a command then
    replaces it); None: a file is recognised when :attr:`load` reads it."""
    description: str = ""
    """What the data is, for messages (e.g. ``"query statistics"``)."""
    takes_tokenizer: bool = False
    """True: ``compute`` also takes ``tokenizer=`` (the tokenizer the data is computed with, e.g. to build the
    token ids of a probe's prompts); called without it, the need finds the model's own or refuses."""
    takes_probe: bool = False
    """True: ``compute`` also takes ``run_probe=``, the runtime's probe runner
    (:data:`polykv.contract.probe.ProbeRunner`): data measured through a probe is computed by a plugin that cannot
    import the runtime, so whoever computes it hands the runner in (:func:`compute_data`)."""


def compute_data(need: ModelDataNeed, model: Any, batches: list, *, tokenizer: Any = None,
                 run_probe: Callable | None = None) -> Any:
    """``need.compute(model, batches)`` with what the need declares it takes: ``tokenizer=`` and ``run_probe=``
    (the runtime's :data:`polykv.contract.probe.ProbeRunner`; a need that takes it is refused without it)."""
    extra: dict[str, Any] = {}
    if need.takes_tokenizer:
        extra["tokenizer"] = tokenizer
    if need.takes_probe:
        if run_probe is None:
            raise ModelDataError(f"{need.description or 'data'} '{need.key}' is measured through the runtime's "
                                 f"probe: pass run_probe=polykv.runtime.session.run_probe to compute it")
        extra["run_probe"] = run_probe
    return need.compute(model, batches, **extra)


def need_of(rule_class: Any) -> ModelDataNeed | None:
    """The rule class's declared need, or None."""
    need = getattr(rule_class, NEED_ATTRIBUTE, None)
    if need is not None and not isinstance(need, ModelDataNeed):
        raise TypeError(f"{getattr(rule_class, '__name__', rule_class)!r}.{NEED_ATTRIBUTE} must be a "
                        f"polykv.contract.model_data.ModelDataNeed or None, got {type(need).__name__}")
    return need


def recognises(need: ModelDataNeed, path: str) -> bool:
    """Whether the file at ``path`` is ``need``'s data as polykv writes it (``need.recognise``, else whether
    ``need.load`` reads it): a command replaces such a file and refuses to overwrite any other."""
    try:
        if need.recognise is not None:
            return bool(need.recognise(path))
        need.load(path)
    except Exception:  # noqa: BLE001 - any failure (a plugin's reader may raise anything) means it is not this data
        return False
    return True


def needs_of_rules(registry: Any, rules: Iterable[str]) -> list[ModelDataNeed]:
    """The distinct needs (by key, first rule first) of the registered rules among ``rules``."""
    out: dict[str, ModelDataNeed] = {}
    for rule in rules:
        if not registry.has("rule", rule):
            continue  # an unknown rule is reported where the plan or settings are checked
        need = need_of(registry.rule(rule))
        if need is not None:
            out.setdefault(need.key, need)
    return list(out.values())


def registered_needs(registry: Any) -> list[ModelDataNeed]:
    """The distinct needs of every registered rule."""
    return needs_of_rules(registry, registry.names("rule"))


def side_file(profile_path: str, suffix: str) -> str:
    """Where a profile's side file with ``suffix`` lives: ``x.profile.json`` -> ``x`` + ``suffix``."""
    base = str(profile_path)
    for ext in (".profile.json", ".json"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base + suffix


def side_file_references(profile_path: str, needs: Iterable[ModelDataNeed]) -> dict[str, str]:
    """``{key: path}`` of each need's side file that exists beside ``profile_path`` (what a plan solved from
    that profile records in its ``model_data`` field)."""
    return {need.key: side_file(profile_path, need.suffix) for need in needs
            if os.path.isfile(side_file(profile_path, need.suffix))}


def load_side_files(profile_path: str, needs: Iterable[ModelDataNeed], *, model: Any = None) -> dict[str, Any]:
    """``{key: data}`` for each need whose side file exists beside ``profile_path`` (checked against
    ``model`` when one is given and the need has a check)."""
    out = {}
    for need in needs:
        path = side_file(profile_path, need.suffix)
        if os.path.isfile(path):
            data = need.load(path)
            if model is not None and need.check is not None:
                need.check(data, model)
            out[need.key] = data
    return out


# -- finding the data a plan needs ------------------------------------------------------------------

MISSING_CHOICES = ("compute", "refuse")
"""What :func:`polykv.apply` does when a rule's data is neither given, nor in the plan's file, nor cached:
``compute`` it from the offline corpus (and cache it), or ``refuse`` in one line."""
CORPUS_TEXTS = 4
"""Offline-corpus texts (mixed prose and code, :mod:`polykv.models.corpus`, seed 0) the data is computed on."""
CORPUS_TOKENS = 512
"""Tokens taken from the start of each text."""


class ModelDataNote(UserWarning):
    """Per-model data was computed on the fly, or a file the plan names was unusable and other data is used (one
    line: what, for which model, the cost or the replacement)."""


def cache_dir() -> str:
    """Folder of computed per-model data: ``$POLYKV_CACHE/model-data``, else ``~/.cache/polykv/model-data``."""
    root = os.environ.get("POLYKV_CACHE")
    return os.path.join(root, "model-data") if root else os.path.join(os.path.expanduser("~"), ".cache", "polykv",
                                                                       "model-data")


def cached_file(need: ModelDataNeed, fingerprint: str) -> str:
    """Where computed data for the model with ``fingerprint`` is cached (one folder per model fingerprint)."""
    safe = "".join(c if c.isalnum() or c in "-_+." else "_" for c in fingerprint)
    return os.path.join(cache_dir(), safe, f"{need.key}{need.suffix}")


def corpus_batches(tokenizer: Any, device: Any) -> list:
    """The token batches per-model data is computed on: :data:`CORPUS_TEXTS` offline-corpus texts, the first
    :data:`CORPUS_TOKENS` tokens of each, as LongTensor [1, T] on ``device``."""
    import torch

    from polykv.models.corpus import corpus_texts

    return [torch.tensor([tokenizer.encode(t, add_special_tokens=False)[:CORPUS_TOKENS]], device=device)
            for t in corpus_texts("mixed", CORPUS_TEXTS, min_chars=4 * CORPUS_TOKENS, seed=0)]


def _load_checked(need: ModelDataNeed, path: str, model: Any, origin: str) -> Any:
    what = f"{path} ({origin}): {need.description or 'data'} '{need.key}'"
    try:
        data = need.load(path)
    except Exception as exc:  # noqa: BLE001 - a plugin's loader may raise anything on a file that is not its data
        raise ModelDataError(f"{what} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                             f"replace the file or remove it to compute the data") from None
    if need.check is not None:
        try:
            need.check(data, model)
        except (PolykvError, ValueError) as exc:
            raise ModelDataError(f"{what} was not measured on this model: {exc}") from None
    return data


def find_model_data(model: Any, needs: Iterable[ModelDataNeed], *, given: Mapping[str, Any] | None = None,
                    files: Mapping[str, Iterable[tuple[str, str]]] | None = None, tokenizer: Any = None,
                    missing: str = "compute", fingerprint: str | None = None,
                    used_by: Mapping[str, str] | None = None, run_probe: Callable | None = None) -> dict[str, Any]:
    """``{need.key: data}`` for every need, found in this order: ``given`` (kept as is); the first existing
    file of ``files[need.key]`` (``(path, origin)`` pairs, e.g. a plan's ``model_data`` reference, a
    profile's side file); the cache (:func:`cached_file`, by model ``fingerprint``); else, with
    ``missing="compute"``, computed over the offline corpus with ``tokenizer`` (a one-line
    :class:`ModelDataNote` with the cost) and cached, or with ``missing="refuse"`` a one-line
    :class:`ModelDataError` naming every file looked for. Loaded files are checked against ``model``.
    ``used_by``: per key, which rule and layers read it (for messages); ``run_probe``: the runtime's probe runner,
    for data computed through a probe (:func:`compute_data`)."""
    if missing not in MISSING_CHOICES:
        raise ModelDataError(f"missing_model_data must be one of {list(MISSING_CHOICES)}, got {missing!r}")
    out = dict(given or {})
    for need in needs:
        if need.key in out:
            continue
        looked, unusable = [], []
        what = f"{need.description or 'data'} '{need.key}'" + (f" for {used_by[need.key]}" if used_by and
                                                                need.key in used_by else "")
        for path, origin in (files or {}).get(need.key, ()):
            looked.append(f"{path} ({origin})")
            if os.path.isfile(path):
                out[need.key] = _load_checked(need, path, model, origin)
                break
            if origin.startswith("plan"):
                # a file the plan names is never silently replaced: refuse, or say what is used instead
                reason = side_file_problem(path)
                if missing == "refuse":
                    cache = f" ({cached_file(need, fingerprint)})" if fingerprint else ""
                    raise ModelDataError(f"{path} ({origin}): {what}: {reason}; restore the file, fix the path, or "
                                         f"pass missing_model_data='compute' to use the cache{cache} or the offline "
                                         f"corpus instead")
                unusable.append(f"{path} ({origin}) {reason}")
        if need.key in out:
            continue
        cached = cached_file(need, fingerprint) if fingerprint else None
        if cached is not None:
            looked.append(f"{cached} (cache)")
            if os.path.isfile(cached):
                _warn_replaced(unusable, f"the cached copy {cached}")
                out[need.key] = _load_checked(need, cached, model, "cache")
                continue
        where = "; looked for " + ", ".join(looked) if looked else "; no file was named for it"
        if missing == "refuse":
            raise ModelDataError(f"{what}: not found{where}; pass model_data={{'{need.key}': ...}} or "
                                 f"missing_model_data='compute' to compute it from the offline corpus")
        if tokenizer is None:
            raise ModelDataError(f"{what}: not found{where}; pass tokenizer=... to compute it from the offline "
                                 f"corpus, or model_data={{'{need.key}': ...}}")
        _warn_replaced(unusable, "data computed from the offline corpus")
        out[need.key] = _compute(need, model, tokenizer, cached, run_probe)
    return out


def side_file_problem(path: str) -> str:
    """Why a side file a plan names cannot be read (checked with ``stat``, without opening it): missing, a dangling
    symlink, or not a regular file."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a symlink to {os.readlink(path)}, which does not exist"
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isfile(path):
        return "is not a regular file (a folder, FIFO or device)"
    return "cannot be read"


def _warn_replaced(unusable: list[str], instead: str) -> None:
    import warnings

    for note in unusable:
        warnings.warn(f"polykv: {note}; using {instead} instead", ModelDataNote, stacklevel=_caller_level())


def compute_over_corpus(need: ModelDataNeed, model: Any, tokenizer: Any, *,
                        run_probe: Callable | None = None) -> tuple[Any, list]:
    """``need``'s data computed over the offline corpus (:func:`corpus_batches`) with ``tokenizer`` (and
    ``run_probe``, :func:`compute_data`), and the batches it was computed on: what the runtime does for missing
    data, and ``polykv model-data`` on purpose."""
    batches = corpus_batches(tokenizer, next(model.parameters()).device)
    return compute_data(need, model, batches, tokenizer=tokenizer, run_probe=run_probe), batches


def _compute(need: ModelDataNeed, model: Any, tokenizer: Any, cached: str | None,
             run_probe: Callable | None = None) -> Any:
    import time
    import warnings

    start = time.perf_counter()
    data, batches = compute_over_corpus(need, model, tokenizer, run_probe=run_probe)
    seconds = time.perf_counter() - start
    saved = ""
    if cached is not None:
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            data.save(cached)
            saved = f", cached at {cached}"
        except Exception as exc:  # noqa: BLE001 - a full disk reaches a plugin's writer as anything; the data is kept
            reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
            warnings.warn(f"{need.description or need.key} ('{need.key}') not cached: cannot write {cached} "
                          f"({reason}); this run uses the computed data, the next computes it again; set "
                          f"POLYKV_CACHE to a writable folder", CacheWriteWarning, stacklevel=_caller_level())
    tokens = sum(int(b.shape[-1]) for b in batches)
    warnings.warn(f"polykv: computed {need.description or need.key} ('{need.key}') over the offline corpus "
                  f"({len(batches)} texts, {tokens} tokens) in {seconds:.1f} s{saved}", ModelDataNote,
                  stacklevel=_caller_level())
    return data


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside polykv above the caller (where the note points)."""
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # polykv/, above contract/
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def tokenizer_of(model: Any) -> Any:
    """The tokenizer saved beside a model loaded from a local folder (``model.name_or_path``), or None."""
    folder = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not folder or not os.path.isdir(str(folder)):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None
