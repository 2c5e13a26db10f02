"""Run a study: every policy on every item, scored, with measured KV bytes, resumable at any point.

Protocol per item (DESIGN.md, evaluation protocol): prefill the *context*, compress it with the
policy's plan, THEN feed the *question* through the compressed cache in one forward, then generate
greedily: :func:`polykv.runtime.answer.answer_from_context`, the code path of :func:`polykv.answer`.
Token ids follow the spec's prompt rule (:mod:`polykv.studies.prompt`): the context starts with the
tokenizer's own leading special tokens (its BOS, where it adds one; ``bos`` overrides), the question
continues without a second BOS, and ``prompt_format`` "chat" wraps both in the chat template, split
right after the context.

Prefill attention runs on the raw prompt before any eviction, so the prefill itself is the same for
every policy; with ``reuse_prefill`` (the default) the context runs through the model once
per item and every policy's cache is restored from that snapshot (:mod:`polykv.runtime.fork`, exact:
the same tokens, logits and bytes as a prefill per policy).

Teacher-forced tasks (``continuation``): after compressing the context, the reference continuation
is fed through the compressed cache one token per decode forward (the decode rule may evict between
them), and each position's next-token distribution is compared with the full cache's
(:mod:`polykv.studies.fidelity`). The full baseline policy is the reference: it runs once per item
(also when its own result is already recorded) and its [positions, vocab] log-probabilities are reused
for every other policy of the item. The record's ``score`` is the top-1 agreement; ``kl``, ``kl_max``,
``ppl`` and ``ppl_full`` sit beside it.

Order of work: :func:`prepare` checks the spec, the results file and solves every plan, all before a
model is loaded, so bad input fails in seconds; :func:`run_study` then loads the model and appends one
durable result line per (policy, task, item), skipping those already in the results file.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import attrs
import torch

import polykv
from polykv.contract.model_data import find_model_data, needs_of_rules, side_file
from polykv.errors import StudyError
from polykv.models import load_default_model, load_model as load_named
from polykv.models.geometry import geometry_of_model
from polykv.plan import Plan, validate_plan
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.runtime.answer import answer_from_context, compress_context, stop_ids
from polykv.runtime.fork import capture_prefill
from polykv.runtime.session import run_probe
from polykv.runtime.tokenizer_params import fill_tokenizer_params
from polykv.studies import fidelity
from polykv.studies.designs import Policy, build_policies, check_policies_fit
from polykv.studies.prompt import PromptEncoder
from polykv.studies.results import ResultsWriter
from polykv.studies.spec import FULL_POLICY, StudySpec
from polykv.studies.tasks.base import TEACHER_FORCED
from polykv.testing import tiny_model


@attrs.define
class Prepared:
    """A checked study ready to run: spec, solved policies and the results writer's path."""

    spec: StudySpec
    policies: list[Policy]
    results_path: str
    warnings: list[str] = attrs.field(factory=list)
    """Things to tell the user that do not stop the study (contexts past the model's positions)."""


def prepare(spec: StudySpec, results_path: str, *, registry=None) -> Prepared:
    """Check the results file against the spec, solve every policy and check that every plan fits the
    spec's model (from its config); loads no model weights."""
    records = ResultsWriter.check_study(results_path, spec)
    policies = build_policies(spec, registry=registry)
    notes = check_policies_fit(spec, policies, registry=registry)
    if records and "files" not in records[0] and spec.side_digests:
        notes.append(f"{results_path}: begun by a polykv that did not record the side files a study reads; resuming "
                     f"without checking that {', '.join(sorted(spec.side_digests))} are unchanged since")
    return Prepared(spec=spec, policies=policies, results_path=results_path, warnings=notes)


class CharTokenizer:
    """Character tokenizer for tiny random-weight models: ids 1..vocab-1 (0 is the pad token)."""

    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + ord(c) % (self.vocab - 1) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (int(i) - 1) % 95) for i in ids)


def load_model(spec: StudySpec):
    """(model, tokenizer) named by ``spec.model``: the default SmolLM2, a named model or a tiny random model."""
    dtype = getattr(torch, spec.dtype)
    if spec.model == "default":
        return load_default_model(dtype=dtype)
    if isinstance(spec.model, str):
        return load_named(spec.model, dtype=dtype)
    kw = dict(spec.model["tiny"])
    model = tiny_model(dtype=dtype, **kw)
    return model, CharTokenizer(model.config.vocab_size)


def plan_model_data(model, tokenizer, plans: list[Plan], profile: str | None, *, registry=None) -> dict[str, Any]:
    """The per-model data the plans' rules declare (:mod:`polykv.contract.model_data`; e.g. query statistics).

    Each is read from the file a plan names for it (its ``model_data`` field), else the profile's side file
    (e.g. ``x.qstats.safetensors``, written by ``polykv calibrate``), else the cache, else computed once
    here on the offline corpus (:func:`polykv.contract.model_data.corpus_batches`) and cached.
    """
    if registry is None:
        registry = get_registry()
    needs = needs_of_rules(registry, sorted({rule for p in plans for rule in p.rules_used()}))
    if not needs:
        return {}
    files: dict[str, list[tuple[str, str]]] = {}
    for p in plans:
        for key, path in p.model_data.items():
            files.setdefault(key, []).append((path, f"plan field model_data.{key}"))
    if profile is not None:
        for need in needs:
            files.setdefault(need.key, []).append((side_file(profile, need.suffix), "profile side file"))
    return find_model_data(model, needs, files=files, tokenizer=tokenizer,
                           fingerprint=geometry_of_model(model).fingerprint, run_probe=run_probe)


def policy_model_data(model, tokenizer, policies: list[Policy], profile: str | None, *,
                      registry=None) -> dict[str, dict[str, Any]]:
    """``{policy name: its per-model data}``: :func:`plan_model_data` once per distinct set of data files the
    plans name (their ``model_data`` fields), so two plans that name different files for one key (query statistics
    of two profiles, say) each run with their own, and plans that name the same (or none) share one load."""
    groups: dict[tuple, list[Policy]] = {}
    for pol in policies:
        groups.setdefault(tuple(sorted(pol.plan.model_data.items())), []).append(pol)
    out: dict[str, dict[str, Any]] = {}
    for members in groups.values():
        data = plan_model_data(model, tokenizer, [p.plan for p in members], profile, registry=registry)
        out.update({p.name: data for p in members})
    return out


def _ids(ids: list[int], device) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=device)


def run_study(prepared: Prepared, *, model=None, tokenizer=None, progress: bool = True,
              on_result: Callable[[dict], None] | None = None, registry=None) -> dict[str, int]:
    """Run every pending (policy, task, item); return counts ``{"run": n, "skipped": m}``.

    Parameters
    ----------
    prepared : Prepared
        From :func:`prepare`.
    model, tokenizer
        Already loaded model and tokenizer; default: :func:`load_model` of the spec.
    progress : bool
        Show a progress bar (tqdm, on stderr).
    on_result : callable, optional
        Called with every result record right after it is written.

    The results file is locked for the whole run (a second writer is refused).
    """
    writer = ResultsWriter.for_study(prepared.results_path, prepared.spec)
    try:
        return _run_locked(prepared, writer, model=model, tokenizer=tokenizer, progress=progress,
                           on_result=on_result, registry=registry)
    finally:
        writer.close()


def _run_locked(prepared: Prepared, writer: ResultsWriter, *, model, tokenizer, progress: bool, on_result,
                registry) -> dict[str, int]:
    study = LoadedStudy.load(prepared, model=model, tokenizer=tokenizer, registry=registry)
    for record in study.policy_records():
        if record["policy"] not in writer.policies:
            writer.append(record)
    work, skipped = pending_work(study.items(), prepared.policies, writer.done)
    counts = {"run": 0, "skipped": skipped}
    bar = _bar(sum(len(w[2]) for w in work), progress, prepared.spec.name)
    try:
        for task, item, todo in work:
            for record in study.run_item(task, item, todo):
                writer.append(record)
                counts["run"] += 1
                bar.update(1)
                if on_result is not None:
                    on_result(record)
    finally:
        bar.close()
    return counts


def pending_work(items, policies: list[Policy], done) -> tuple[list[tuple[Any, Any, list[Policy]]], int]:
    """``([(task, item, policies still to run on it)], number already done)`` over ``items``
    (from :meth:`LoadedStudy.items`), skipping every (policy, task, item) key in ``done``."""
    work, skipped = [], 0
    for task, task_items in items:
        for item in task_items:
            todo = [p for p in policies if (p.name, task.name, item.id) not in done]
            skipped += len(policies) - len(todo)
            if todo:
                work.append((task, item, todo))
    return work, skipped


@attrs.define
class LoadedStudy:
    """A prepared study with its model loaded: what every process that runs items holds once.

    :func:`run_study` uses one in-process; :mod:`polykv.studies.distributed` builds one per worker and
    calls :meth:`run_item` for the items it is sent, so both paths run exactly the same code per item.
    """

    spec: StudySpec
    policies: list[Policy]
    model: Any
    tokenizer: Any
    geometry: Any
    model_data: dict[str, dict[str, Any]]
    """Per policy name, the per-model data its plan reads (:func:`policy_model_data`)."""
    encoder: PromptEncoder
    """The spec's prompt rule: how item texts become token ids."""
    stop: frozenset[int]
    """Token ids that end a generation."""
    registry: Any = None

    @classmethod
    def load(cls, prepared: Prepared, *, model=None, tokenizer=None, registry=None) -> "LoadedStudy":
        """Load the spec's model (unless given), check the profile and every plan against it."""
        spec, policies = prepared.spec, prepared.policies
        if model is None:
            model, tokenizer = load_model(spec)
        geo = geometry_of_model(model)
        if spec.profile is not None:
            load_profile(spec.profile).check_model(geo)
        for pol in policies:
            validate_plan(pol.plan, registry=registry, geometry=geo, source=f"policy '{pol.name}'")
        # rule parameters built from the tokenizer (KVzip's prompt ids) where a plan leaves them unset
        plugins = registry or get_registry()
        policies = [attrs.evolve(pol, plan=fill_tokenizer_params(pol.plan, plugins, model, tokenizer))
                    for pol in policies]
        model_data = policy_model_data(model, tokenizer, policies, spec.profile, registry=registry)
        encoder = PromptEncoder(tokenizer, bos=spec.bos, prompt_format=spec.prompt_format, where=spec.source)
        return cls(spec=spec, policies=policies, model=model, tokenizer=tokenizer, geometry=geo,
                   model_data=model_data, encoder=encoder, stop=stop_ids(model, tokenizer), registry=registry)

    def policy_records(self) -> list[dict[str, Any]]:
        """The ``policy`` line of every policy, in spec order."""
        return [pol.record(self.geometry, self.spec.context_tokens) for pol in self.policies]

    def items(self) -> list[tuple[Any, list]]:
        """``[(task, [items])]`` for every task entry of the spec, made with this study's prompt rule."""
        out = []
        for t in self.spec.tasks:
            task = (self.registry or get_registry()).task(t.task)()
            out.append((task, list(task.make_items(self.encoder, t.samples, t.seed, **t.params))))
        return out

    def run_item(self, task, item, todo: list[Policy]) -> Iterator[dict[str, Any]]:
        """Run the policies ``todo`` on one item; yield one result record per policy as it finishes.

        The context is prefilled once for all of them (with ``reuse_prefill``); a teacher-forced task
        also runs the full baseline as the reference, whether or not it is in ``todo``.
        """
        spec, model, tokenizer, registry = self.spec, self.model, self.tokenizer, self.registry
        geo, model_data, encoder = self.geometry, self.model_data, self.encoder
        device = next(model.parameters()).device
        full = next((p for p in self.policies if p.name == FULL_POLICY), None)
        with torch.no_grad():
            ctx, question = (_ids(ids, device) for ids in encoder.prompt_ids(item.context, item.question))
            forced = task.mode == TEACHER_FORCED
            if forced and full is None:
                raise StudyError(f"{spec.source}: task '{task.name}' is teacher_forced and needs the full "
                                 "baseline policy as its reference; set \"baseline\": true")
            run = todo + ([full] if forced and full.name not in {p.name for p in todo} else [])
            snaps: dict[int, tuple] = {}  # one shared prefill per distinct per-model data of the policies
            if spec.reuse_prefill:
                for data in {id(model_data[p.name]): model_data[p.name] for p in run}.values():
                    start = time.perf_counter()
                    snap = capture_prefill(model, ctx, [p.plan for p in run if model_data[p.name] is data],
                                           registry=registry, chunk_size=spec.chunk_size, model_data=data)
                    snaps[id(data)] = (snap, time.perf_counter() - start)
            snap_of = lambda pol: snaps.get(id(model_data[pol.name]), (None, None))[0]  # noqa: E731
            ref = None
            if forced:
                cont = _ids(encoder.text_ids(item.answers[0]), device)
                ref = _run_forced(model, full, task, item, ctx, cont, snap_of(full), None, spec=spec, geo=geo,
                                  model_data=model_data[full.name], registry=registry)
            for pol in todo:
                if forced:
                    record = ref if pol.name == full.name else _run_forced(
                        model, pol, task, item, ctx, cont, snap_of(pol), ref["reference"], spec=spec, geo=geo,
                        model_data=model_data[pol.name], registry=registry)
                    record = {k: v for k, v in record.items() if k != "reference"}
                else:
                    record = _run_policy(model, pol, task, item, ctx, question, snap_of(pol), spec=spec, geo=geo,
                                         model_data=model_data[pol.name], stop=self.stop, tokenizer=tokenizer,
                                         registry=registry)
                if snaps:
                    record["prefill_seconds"] = snaps[id(model_data[pol.name])][1]
                record["bos_first"] = encoder.bos_id is not None and int(ctx[0, 0]) == encoder.bos_id
                yield record


def _run_policy(model, pol: Policy, task, item, ctx: torch.Tensor, question: torch.Tensor, snap, *, spec: StudySpec,
                geo, model_data, stop, tokenizer, registry) -> dict[str, Any]:
    """Compress ``ctx`` [1, T] with ``pol``'s plan (restored from ``snap`` or prefilled), feed ``question``
    [1, q] through the compressed cache, generate greedily; the result record."""
    start = time.perf_counter()
    with polykv.apply(model, pol.plan, model_data=model_data, registry=registry,
                      storage_dtype=_storage(spec)) as session:
        run = answer_from_context(session, ctx, question, max_new_tokens=item.max_new_tokens, stop=stop,
                                  snapshot=snap, chunk_size=spec.chunk_size)
    kv, tokens, end = run.context_bytes, run.tokens, run.end_bytes
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    record = _base_record(pol, task, item, ctx, kv, geo, next(model.parameters()).element_size())
    record.update({"score": float(task.score(item, text)), "generated": text, "answers": list(item.answers),
                   "kv_bytes_end": end.total, "question_tokens": int(question.shape[1]), "new_tokens": len(tokens),
                   "seconds": time.perf_counter() - start, "prefill_seconds": None,
                   "reused_prefill": snap is not None})
    return record


def _base_record(pol: Policy, task, item, ctx: torch.Tensor, kv, geo, elem: int) -> dict[str, Any]:
    T = int(ctx.shape[1])
    return {
        "kind": "result", "policy": pol.name, "task": task.name, "item": item.id,
        "kv_bytes": kv.total, "kv_bytes_per_layer": list(kv.per_layer), "metadata_bytes": kv.metadata_total,
        "full_kv_bytes": geo.full_cache_bytes(T, dtype_bytes=elem), "context_tokens": T,
        "full_kv_bytes_16bit": geo.full_cache_bytes(T, dtype_bytes=2),
        "meta": {k: v for k, v in item.meta.items() if isinstance(v, (int, float, str, bool))},
    }


def _run_forced(model, pol: Policy, task, item, ctx: torch.Tensor, cont: torch.Tensor, snap, ref, *,
                spec: StudySpec, geo, model_data, registry) -> dict[str, Any]:
    """Compress ``ctx`` [1, T] with ``pol``'s plan, teacher-force ``cont`` [1, n] through the compressed cache
    and compare with ``ref`` (:class:`~polykv.studies.fidelity.Reference`); with ``ref`` None, ``pol`` is the
    full cache and the record carries its own reference under ``"reference"`` (not written)."""
    where = f"policy '{pol.name}', task '{task.name}' item {item.id}"
    start = time.perf_counter()
    with polykv.apply(model, pol.plan, model_data=model_data, registry=registry,
                      storage_dtype=_storage(spec)) as session:
        kv = compress_context(session, ctx, snap, spec.chunk_size)
        if ref is None:
            own = fidelity.reference(session, cont, where=where)
            fid = fidelity.of_reference(own)
        else:
            own, fid = None, fidelity.compare(session, cont, ref, where=where)
        end = session.resident_bytes()
    record = _base_record(pol, task, item, ctx, kv, geo, next(model.parameters()).element_size())
    record.update(fid.as_record())
    record.update({"score": fid.top1, "generated": "", "answers": [], "kv_bytes_end": end.total,
                   "question_tokens": 0, "continuation_tokens": int(cont.shape[1]), "new_tokens": 0,
                   "seconds": time.perf_counter() - start, "prefill_seconds": None,
                   "reused_prefill": snap is not None, "reference": own})
    return record


def _storage(spec: StudySpec):
    """The torch dtype the spec stores the cache in (None: the compute dtype)."""
    return None if spec.storage_dtype is None else getattr(torch, spec.storage_dtype)


def _bar(total: int, enabled: bool, name: str):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=f"study {name}", unit="run", dynamic_ncols=True)

