"""``polykv model-data``: compute per-model data (KVzip head scores, query statistics, key/value bases) into a file.

Rules that read data measured on the model (``kvzip-head``'s head scores, TriAttention's query statistics, the
low-rank axis's key/value bases) find it beside a profile, in a plan's ``model_data`` or in the cache,
and compute it over the offline corpus when it is missing. This verb computes one kind on purpose, through the same
code, and writes it where you say: to ship it beside a profile (``<profile stem><suffix>``), name it in a plan's
``model_data``, or compare two models' data.

    polykv model-data --list
    polykv model-data default kvzip-head -o profiles/smollm2-135m-instruct.kvzip-head.safetensors
    polykv model-data default kvzap --texts 5 --tokens 800 -o profiles/smollm2-135m-instruct.kvzap.safetensors

``--texts``/``--tokens`` size the offline-corpus sample (default: the runtime's, 4 texts of 512 tokens). Data whose
computation reports progress (the kvzap surrogate's training) prints it to stderr with an estimate of the time left,
and keeps what each text gave in ``FILE.partial/``: run the same command again after an interruption to resume.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import time

from polykv.atomic import check_output
from polykv.contract.model_data import CORPUS_TEXTS, CORPUS_TOKENS, compute_over_corpus, corpus_batches, need_of
from polykv.errors import OutputError, PolykvError, ProfileError, StudyError
from polykv.models.devices import check_device
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.models.corpus import corpus_texts
from polykv.models.local_folder import check_model_folder, is_model_name, load_by_name
from polykv.registry import get_registry
from polykv.runtime.session import run_probe


def register(subparsers) -> None:
    p = subparsers.add_parser("model-data", help="compute per-model data (KVzip head scores, query statistics, "
                                                 "key/value bases) into a file",
                              description="Compute the per-model data a rule reads (by its key, see --list) over "
                                          "the offline corpus, exactly as the runtime computes missing data, and "
                                          "write it atomically.")
    p.add_argument("model", nargs="?", help="'default', a model name (gemma3-270m) or a local Hugging Face folder")
    p.add_argument("key", nargs="?", help="which data (see --list)")
    p.add_argument("-o", "--output", metavar="FILE", help="file to write (atomically)")
    p.add_argument("--list", action="store_true", help="list the kinds of per-model data and the rules that read them")
    p.add_argument("--device", default="cpu", metavar="DEV", help="device to compute on (default cpu)")
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help="model dtype: float32 (default), bfloat16 (bf16) or float16 (fp16)")
    p.add_argument("--texts", type=int, default=CORPUS_TEXTS, metavar="N",
                   help=f"offline-corpus texts to compute over (default {CORPUS_TEXTS})")
    p.add_argument("--tokens", type=int, default=CORPUS_TOKENS, metavar="N",
                   help=f"tokens taken from the start of each text (default {CORPUS_TOKENS})")
    p.set_defaults(func=run)


def known_needs(registry) -> dict:
    """``{key: (need, readers)}`` for every registered rule's need and the low-rank axis's bases."""
    out = {}
    for name in registry.names("rule"):
        need = need_of(registry.get("rule", name))
        if need is not None:
            out.setdefault(need.key, (need, []))[1].append(f"rule '{name}'")
    out.setdefault(KV_BASES_NEED.key, (KV_BASES_NEED, []))[1].append("plans with k_rank/v_rank")
    return dict(sorted(out.items()))


def run(args) -> int:
    needs = known_needs(get_registry())
    if args.list:
        for key, (need, readers) in needs.items():
            print(f"{key:22} {need.description or '-':28} side file *{need.suffix:28} read by {', '.join(readers)}")
        return 0
    if not args.model or not args.key or not args.output:
        raise PolykvError("polykv model-data: give MODEL KEY -o FILE (or --list)")
    if args.key not in needs:
        raise PolykvError(f"polykv model-data: unknown key {args.key!r}; known are {sorted(needs)} (see --list)")
    need = needs[args.key][0]
    def recognise(path: str) -> bool:
        try:
            need.load(path)
        except Exception:  # noqa: BLE001 - any failure means the file is not this data
            return False
        return True

    for opt, value, low, high in (("--texts", args.texts, 1, 10000), ("--tokens", args.tokens, 8, 1 << 20)):
        if not low <= value <= high:
            raise PolykvError(f"polykv model-data: {opt} must be in [{low}, {high}], got {value}")
    check_output(args.output, what=f"{need.description or need.key} file", option="-o", recognise=recognise)
    texts = _corpus(args)   # refused before the model loads when the corpus is too small
    args.dtype = check_device(args.device, args.dtype)
    if not is_model_name(args.model):
        check_model_folder(args.model, weights=True)
    model, tokenizer = load_by_name(args.model, dtype=args.dtype, device=args.device, error=ProfileError)
    start = time.perf_counter()
    data, batches = _compute(need, model, tokenizer, texts, args)
    try:
        data.save(args.output)
    except Exception as exc:  # noqa: BLE001 - a full disk reaches a plugin's writer as anything; nothing is left
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise OutputError(f"{args.output}: cannot write the {need.description or need.key} ({reason}); nothing was "
                          "written: free disk space or choose another -o") from None
    shutil.rmtree(args.output + PARTIAL, ignore_errors=True)
    tokens = sum(int(b.shape[-1]) for b in batches)
    print(f"{args.output}: {need.description or need.key} ('{need.key}') of {args.model} over the offline corpus "
          f"({len(batches)} texts, {tokens} tokens) in {time.perf_counter() - start:.1f} s; beside a profile name it "
          f"<profile stem>{need.suffix}, or name it in a plan's model_data as {{\"{need.key}\": \"{args.output}\"}}")
    return 0


PARTIAL = ".partial"
"""Folder beside the output where a computation that takes ``checkpoint=`` keeps its progress (removed when done)."""


def _corpus(args) -> list[str] | None:
    """The corpus texts ``--texts``/``--tokens`` ask for (None: the runtime's own sample, the defaults)."""
    if (args.texts, args.tokens) == (CORPUS_TEXTS, CORPUS_TOKENS):
        return None
    try:
        return corpus_texts("mixed", args.texts, min_chars=4 * args.tokens, seed=0)
    except StudyError as exc:  # too few texts that long
        raise PolykvError(f"polykv model-data: --texts {args.texts} --tokens {args.tokens}: {exc}; ask for fewer "
                          f"texts or tokens") from None


def _compute(need, model, tokenizer, texts, args) -> tuple:
    """``need``'s data over ``texts`` (the first ``args.tokens`` tokens of each; None: the runtime's own sample),
    with progress on stderr and a checkpoint beside the output when its computation takes them."""
    batches = None
    if texts is not None:
        import torch

        device = next(model.parameters()).device
        batches = [torch.tensor([tokenizer.encode(t, add_special_tokens=False)[:args.tokens]], device=device)
                   for t in texts]
    takes = inspect.signature(need.compute).parameters
    extra = {}
    if "progress" in takes:
        extra["progress"] = lambda line: print(line, file=sys.stderr, flush=True)
    if "checkpoint" in takes:
        extra["checkpoint"] = args.output + PARTIAL
        if os.path.isdir(extra["checkpoint"]):
            print(f"polykv model-data: resuming from {extra['checkpoint']}", file=sys.stderr)
    if batches is None and not extra:
        return compute_over_corpus(need, model, tokenizer, run_probe=run_probe)
    if batches is None:
        batches = corpus_batches(tokenizer, next(model.parameters()).device)
    if need.takes_tokenizer:
        extra["tokenizer"] = tokenizer
    if need.takes_probe:
        extra["run_probe"] = run_probe
    return need.compute(model, batches, **extra), batches
