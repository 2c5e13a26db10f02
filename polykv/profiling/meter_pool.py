"""Whole plans measured on a Ray cluster: :class:`~polykv.profiling.plan_meter.PlanMeter` on every worker.

A measuring solver (``refine``) spends its time measuring candidate plans, each independent of the others once the
search knows which candidates a step tries. :class:`MeterPool` starts Ray workers (actors that load the model once
with ``loader`` and build the same :class:`PlanMeter` from the same arguments: sequences, prefix, scored rows,
weights, layer menu, per-model data, storage dtype, seed) and measures a list of plans on them, each plan on one free
worker, the values returned in the plans' order. With the same thread count a worker computes what the serial meter
computes, so the search's decisions are the serial run's (a test checks it on a local Ray). A worker that dies has
its plan sent again (``max_attempts`` in all); an error raised by polykv code in a worker stops the search with it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from polykv.profiling import ray_fanout
from polykv.errors import PolykvError, SolverError
from polykv.profiling.plan_meter import PlanMeter


class MeterWorker:
    """One Ray worker: the model loaded once (``loader()`` -> (model, tokenizer)), one :class:`PlanMeter` built from
    ``meter_args`` (its keyword arguments but the model), measuring one plan at a time."""

    def __init__(self, loader: Callable[[], tuple], threads: int | None, meter_args: Mapping[str, Any]):
        import torch

        if threads:
            torch.set_num_threads(threads)
        model, _ = loader()
        self.error = None
        try:
            self.meter = PlanMeter(model, **meter_args)
        except PolykvError as exc:  # reported by the driver at the first measurement
            self.error = (type(exc).__name__, str(exc))

    def measure(self, plan) -> tuple[float | None, int, tuple | None]:
        """(measured KL, prefills run so far, None), or (None, 0, the error) for bad input."""
        if self.error is not None:
            return None, 0, self.error
        try:
            return self.meter.measure(plan), self.meter.prefills, None
        except PolykvError as exc:
            return None, self.meter.prefills, (type(exc).__name__, str(exc))


class MeterPool:
    """Ray workers measuring plans (module docstring). ``address`` None uses the Ray already initialised in this
    process, else starts a local one (``"local"``) or joins a cluster (``"auto"``, ``"host:6379"``); ``workers``
    None: the cluster's CPUs / ``cpus_per_worker``. Close it (or use it as a context manager) to free the workers."""

    def __init__(self, loader: Callable[[], tuple], meter_args: Mapping[str, Any], *, address: str | None = None,
                 workers: int | None = None, cpus_per_worker: float = 1, threads: int | None = None,
                 max_attempts: int = 3):
        if workers is not None and workers < 1 or not cpus_per_worker > 0:
            raise SolverError(f"Ray workers {workers} / CPUs per worker {cpus_per_worker}: give a positive number of "
                              f"workers and of CPUs per worker (--workers, --cpus-per-worker)")
        self.ray = ray_fanout.ray_module(SolverError, "measuring plans on Ray")
        self.loader, self.meter_args = loader, dict(meter_args)
        self.cpus, self.threads, self.max_attempts = cpus_per_worker, threads, int(max_attempts)
        self.actors: list = []
        self.prefills: dict[int, int] = {}
        """Per worker, the prefills its meter has run."""
        self.started_here = ray_fanout.start(self.ray, None if address in (None, "local") else address)
        if workers is None:
            workers = ray_fanout.room_for(self.ray, cpus_per_worker)
        if workers < 1:
            self.close()
            raise SolverError(f"the Ray cluster has room for no worker ({self.ray.cluster_resources()}) with "
                              f"{cpus_per_worker} CPUs each; lower --cpus-per-worker")
        self.actors = [self._new() for _ in range(workers)]

    def _new(self):
        remote = self.ray.remote(MeterWorker)
        return remote.options(num_cpus=self.cpus, max_restarts=0).remote(
            self.loader, self.threads or max(1, int(self.cpus)), self.meter_args)

    def measure(self, plans: Sequence[Any]) -> list[float]:
        """The measured KL of each plan, in order."""
        out: list[float | None] = [None] * len(plans)

        def collect(i: int, j: int, answer: tuple) -> None:
            value, prefills, error = answer
            if error is not None:
                raise SolverError(f"measuring a candidate plan on a Ray worker: {error[1]}")
            out[j] = value
            self.prefills[i] = prefills

        def gave_up(j: int, attempts: int, exc: BaseException) -> SolverError:
            return SolverError(f"candidate plan {j + 1} of {len(plans)}: the Ray worker died {attempts} times "
                               f"measuring it ({type(exc).__name__}); see the Ray logs of the worker (out of memory?)")

        ray_fanout.fan_out(self.ray, self.actors, self._new, range(len(plans)),
                           lambda actor, j: actor.measure.remote(plans[j]), collect, gave_up,
                           max_attempts=self.max_attempts, on_replace=lambda i: self.prefills.pop(i, None))
        return [float(v) for v in out]

    def close(self) -> None:
        ray_fanout.release(self.ray, self.actors, self.started_here)
        self.actors, self.started_here = [], False

    def __enter__(self) -> "MeterPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
