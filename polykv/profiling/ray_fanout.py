"""Independent jobs fanned out over Ray workers: submit, wait, send again what a dead worker had, collect.

Three parts of polykv run independent jobs on Ray actors that each load a model once: calibration (one layer a
job), the measuring solver (one candidate plan a job) and studies (one item's policies a job). They share
:func:`fan_out`: every free worker is sent the next job; the driver waits for any one to come back, in short steps
so that Ctrl-C stops it; a worker that dies (killed, out of memory, node lost) is replaced by a fresh actor and its
job is sent again first, up to ``max_attempts`` times in all, after which the caller's error stops the run. What a
job's answer means (a value, rows, records, an error raised by polykv code in the worker) is the caller's.

It sits in the profiling layer, the lowest both calibration and studies import; it imports nothing of polykv
but the errors. ``ray`` itself is imported only when a run asks for it (:func:`ray_module`): it is optional.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

from polykv.errors import PolykvError

WAIT_S = 0.5
"""Longest time the driver blocks in Ray before Python can see a Ctrl-C."""
INSTALL_HINT = "install it with: pip install 'polykv-compose[ray]'"


def ray_module(error: type[PolykvError], doing: str):
    """The ``ray`` module, or ``error`` saying that ``doing`` (e.g. "calibrating on Ray") needs it installed."""
    try:
        import ray
    except ImportError:
        raise error(f"{doing} needs the 'ray' package, which is not installed; {INSTALL_HINT}") from None
    return ray


def start(ray, address: str | None) -> bool:
    """Start or join Ray at ``address`` unless it is already initialised in this process; True if started here."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    return True


def room_for(ray, cpus_per_worker: float, gpus_per_worker: float = 0) -> int:
    """How many workers of that size the cluster holds: its GPUs / ``gpus_per_worker`` when that is > 0, else its
    CPUs / ``cpus_per_worker``."""
    resources = ray.cluster_resources()
    if gpus_per_worker:
        return int(resources.get("GPU", 0) // gpus_per_worker)
    return int(resources.get("CPU", 1) // cpus_per_worker)


def release(ray, actors: Iterable, started_here: bool) -> None:
    """Kill the actors and shut Ray down if :func:`start` started it."""
    for actor in actors:
        ray.kill(actor, no_restart=True)
    if started_here and ray.is_initialized():
        ray.shutdown()


def wait_get(ray, ref):
    """``ray.get(ref)``, waiting in short steps so that Ctrl-C stops the driver."""
    while not ray.wait([ref], timeout=WAIT_S)[0]:
        pass
    return ray.get(ref)


def fan_out(ray, actors: list, new_actor: Callable[[], Any], jobs: Iterable, submit: Callable[[Any, Any], Any],
            collect: Callable[[int, Any, Any], None], gave_up: Callable[[Any, int, BaseException], Exception], *,
            max_attempts: int = 3, key: Callable[[Any], Any] = lambda job: job,
            on_dispatch: Callable[[int, Any], None] | None = None,
            on_replace: Callable[[int], None] | None = None) -> int:
    """Run every job on ``actors`` (one job at a time on each), in order as workers free up; return how many jobs
    were sent again after their worker died.

    ``submit(actor, job)`` sends a job and returns its object ref; ``collect(worker index, job, answer)`` takes each
    answer as it comes back (it may raise to stop the run). A worker that dies is killed for good, replaced in
    ``actors`` by ``new_actor()`` (then ``on_replace(worker index)``) and its job goes to the head of the queue;
    a job whose worker died ``max_attempts`` times raises ``gave_up(job, attempts, the Ray error)`` instead.
    ``key(job)`` names a job for counting attempts (jobs need not be hashable). ``on_dispatch(worker pid,
    key(job))`` is called after each job is sent; the actor must then have a ``pid()`` method, asked once per
    actor before its first job is queued behind it."""
    died = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)
    queue, attempts = collections.deque(jobs), collections.Counter()
    running: dict = {}  # ref -> (worker index, job)
    pids: dict[int, int] = {}
    retried = 0

    def dispatch(i: int) -> None:
        if not queue:
            return
        if on_dispatch is not None and i not in pids:
            pids[i] = wait_get(ray, actors[i].pid.remote())
        job = queue.popleft()
        attempts[key(job)] += 1
        running[submit(actors[i], job)] = (i, job)
        if on_dispatch is not None:
            on_dispatch(pids[i], key(job))

    for i in range(len(actors)):
        dispatch(i)
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_S)
        if not ready:
            continue
        i, job = running.pop(ready[0])
        try:
            answer = ray.get(ready[0])
        except died as exc:
            if attempts[key(job)] >= max_attempts:
                raise gave_up(job, attempts[key(job)], exc) from None
            queue.appendleft(job)
            retried += 1
            ray.kill(actors[i], no_restart=True)
            actors[i] = new_actor()
            pids.pop(i, None)
            if on_replace is not None:
                on_replace(i)
            dispatch(i)
            continue
        collect(i, job, answer)
        dispatch(i)
    return retried
