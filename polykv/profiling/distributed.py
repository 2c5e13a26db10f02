"""Calibrate on a Ray cluster: the per-layer work fanned out over workers, the profile assembled by the driver.

A calibration's cost is its layers: for each one, every config's ``l2`` and every measured config's end-to-end KL
on every objective (:mod:`polykv.profiling.calibrate`). Each layer's rows depend only on the model, the sequences
and the settings, so each Ray worker (an actor that loads the model once, with ``loader``) is sent one layer at a
time and runs :func:`~polykv.profiling.calibrate.calibrate` restricted to it (``layers=[l]``: the same code, the
same seeds, the same set-up as a serial run), and returns its rows. The driver collects them and assembles the
profile with ``calibrate(..., precomputed=rows)``, which computes nothing per layer, so the profile is the serial
run's (a test checks it on a local Ray). A worker that dies has its layer sent again (``max_attempts`` in all);
an error raised by polykv code in a worker stops the run with that error. Layers finish in any order; the driver
writes nothing until the end (an interrupted Ray run computes its layers again).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import attrs

from polykv.profiling import ray_fanout
from polykv.errors import PolykvError, ProfileError
from polykv.models.geometry import geometry_of_model
from polykv.profiling.calibrate import calibrate
from polykv.profiling.calibrate_settings import CalibrationResult, CalibrationSettings


class CalibrationWorker:
    """One Ray worker: the model loaded once (``loader()`` -> (model, tokenizer)), calibrating one layer at a time."""

    def __init__(self, loader: Callable[[], tuple], threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model, self.tokenizer = loader()

    def pid(self) -> int:
        return os.getpid()

    def layer(self, sequences, settings: CalibrationSettings, heldout, layer: int, corpus: str) -> dict[str, Any]:
        """The table rows of ``layer`` (what a checkpoint holds), as a serial run computes them."""
        try:
            result = calibrate(self.model, sequences, settings, heldout=heldout, corpus=corpus,
                               tokenizer=self.tokenizer, layers=[layer])
        except PolykvError as exc:  # bad input: reported by the driver as it is
            return {"__error__": (type(exc).__name__, str(exc))}
        return result.arrays[layer]


def calibrate_ray(loader: Callable[[], tuple], sequences: Sequence, settings: CalibrationSettings = CalibrationSettings(),
                  *, heldout: Sequence = (), corpus: str = "", address: str | None = None, workers: int | None = None,
                  cpus_per_worker: float = 1, threads: int | None = None, max_attempts: int = 3,
                  progress: Callable[[int, int], None] | None = None,
                  on_dispatch: Callable[[int, int], None] | None = None, driver: tuple | None = None
                  ) -> CalibrationResult:
    """:func:`~polykv.profiling.calibrate.calibrate` with its layers computed on Ray workers (module docstring).

    ``loader`` (picklable: a module-level function or a ``functools.partial`` of one) returns ``(model, tokenizer)``
    on each worker and on the driver; ``address`` None uses the Ray already initialised in this process, else starts
    a local one (``"auto"`` or ``"host:6379"`` joins a cluster). ``progress(done, total)`` is called after each
    layer; ``on_dispatch(worker_pid, layer)`` after each layer is sent. ``driver``: the ``(model, tokenizer)`` the
    driver already loaded (else it calls ``loader`` too)."""
    ray = ray_fanout.ray_module(ProfileError, "calibrating on Ray")
    start = time.perf_counter()
    model, tokenizer = driver if driver is not None else loader()
    L = geometry_of_model(model).num_layers
    remote = ray.remote(CalibrationWorker)
    actors: list = []
    rows: dict[int, dict] = {}

    def new_actor():
        return remote.options(num_cpus=cpus_per_worker, max_restarts=0).remote(loader, threads or
                                                                               max(1, int(cpus_per_worker)))

    def collect(i: int, layer: int, got: dict) -> None:
        if "__error__" in got:
            raise ProfileError(f"layer {layer} (on a Ray worker): {got['__error__'][1]}")
        rows[layer] = got
        if progress is not None:
            progress(len(rows), L)

    def gave_up(layer: int, attempts: int, exc: BaseException) -> ProfileError:
        return ProfileError(f"layer {layer}: the Ray worker died {attempts} times calibrating it "
                            f"({type(exc).__name__}); see the Ray logs of the worker (out of memory?)")

    started_here = ray_fanout.start(ray, address)
    try:
        if workers is None:
            workers = ray_fanout.room_for(ray, cpus_per_worker)
        if workers < 1:
            raise ProfileError(f"the Ray cluster has room for no worker ({ray.cluster_resources()}) with "
                               f"{cpus_per_worker} CPUs each; lower --cpus-per-worker")
        actors = [new_actor() for _ in range(min(workers, L))]
        ray_fanout.fan_out(ray, actors, new_actor, range(L),
                           lambda actor, layer: actor.layer.remote(list(sequences), settings, list(heldout), layer,
                                                                   corpus),
                           collect, gave_up, max_attempts=max_attempts, on_dispatch=on_dispatch)
    finally:
        ray_fanout.release(ray, actors, started_here)
    result = calibrate(model, sequences, settings, heldout=heldout, corpus=corpus, tokenizer=tokenizer,
                       precomputed=rows)
    return attrs.evolve(result, seconds=time.perf_counter() - start)
