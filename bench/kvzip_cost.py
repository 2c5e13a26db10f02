"""KVzip's cost targets on the default model (SmolLM2), each against vanilla measured in the same run.

Time: one process; vanilla prefill of T tokens, then the kvzip prefill (the prompt forward, its
context-reconstruction probe and the selection), both computing the logits of the last position only
(``logits_to_keep=1``: the comparison is between cache-building passes, no vocabulary projection of
every prompt position); best of ``--repeats`` each.

Each time is reported as wall time and as the process's CPU time (``time.process_time``, every thread's): on a
shared machine the wall time of one run swings with the load of others, while the CPU time of a one-thread run
(``OMP_NUM_THREADS=1``) barely moves, so ``OMP_NUM_THREADS=1 ... --repeats 2`` gives the steadier ratio. With
several threads the script also reports the busiest thread's CPU time (Linux ``/proc/self/task``): run with
``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep instead of spinning), it is the prefill's critical path, close to its
wall time on an otherwise idle machine, and a loaded machine barely moves it.

``--breakdown`` also times, inside the kvzip prefill, the probe's forwards (``ProbePass.run_chunks``) and within
them the probe's attention fused with its scoring (``attend_and_score``, where the rule has it) and the separate
scoring (``reconstruction_scores``, the path of layers the runtime attends); the rest is the prompt forward and the
selection.

Memory: two fresh subprocesses (vanilla, kvzip), each loading the model, running one prefill of T tokens,
and reporting the process's peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the
basis) and its resident memory right before the prefill; printed as the ratio of peaks and the ratio of
the prefill's own increments (peak minus the resident memory before it, the stricter basis).

The probe runs after the prompt, at positions T .. T + chunk + prompt ids, so on SmolLM2 (8192 positions)
the longest prompt whose default 2048-token chunk fits is about 6100 tokens. Usage::

    OMP_NUM_THREADS=2 python bench/kvzip_cost.py --time-tokens 4096 --memory-tokens 6100
    OMP_NUM_THREADS=2 python bench/kvzip_cost.py --breakdown 4096
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

import peak_memory

RATIO = 0.3


def _setup(T: int):
    import polykv
    from polykv.adapters.rules.kvzip import prompt_params
    from polykv.models import load_default_model
    from polykv.models.corpus import corpus_texts
    from polykv.models.geometry import geometry_of_model
    from polykv.plan import OpSpec

    model, tok = load_default_model()
    text = " ".join(corpus_texts("mixed", 24, min_chars=4000, seed=0))
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[:T]])
    if ids.shape[1] < T:
        raise SystemExit(f"the offline corpus gave {ids.shape[1]} tokens, fewer than {T}")
    plan = polykv.uniform_plan(geometry_of_model(model), decode="full",
                               prefill=OpSpec(rule="kvzip", capacity_ratio=RATIO, params=prompt_params(tok)))
    return model, ids, plan


def _vanilla(model, ids):
    model(ids, use_cache=True, logits_to_keep=1)


def _kvzip(session, ids):
    session.prefill(ids, logits_to_keep=1)
    return session.cache.probe_tokens


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each of the process's threads so far (Linux ``/proc/self/task``; empty elsewhere)."""
    got = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return got
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        got[task] = (int(fields[11]) + int(fields[12])) / tick   # utime + stime
    return got


def _busiest(before: dict[str, float]) -> float:
    """The largest CPU time any thread spent since ``before`` (a :func:`_thread_cpu`)."""
    return max((cpu - before.get(task, 0.0) for task, cpu in _thread_cpu().items()), default=0.0)


def child(kind: str, T: int) -> None:
    import polykv

    model, ids, plan = _setup(T)
    with torch.no_grad():
        before = peak_memory.rss_now()
        if kind == "vanilla":
            _vanilla(model, ids)
        else:
            with polykv.apply(model, plan) as session:
                _kvzip(session, ids)
    peak_memory.report(kind, before)


class _Timed:
    """Wall time spent in one function, wrapped in place for the run (``--breakdown``)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.original = getattr(owner, name, None)

    def __enter__(self):
        if self.original is None:  # not in this version of polykv: nothing to time
            return self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            setattr(self.owner, self.name, self.original)


def breakdown_run(T: int) -> None:
    """One kvzip prefill of T tokens, split into probe forwards, their attention and scoring, beside one vanilla
    prefill."""
    import polykv
    import polykv.adapters.rules.kvzip as kvzip
    from polykv.runtime.probe_pass import ProbePass

    model, ids, plan = _setup(T)
    with torch.no_grad():
        _vanilla(model, ids[:, :256])  # warm-up
        start = time.perf_counter()
        _vanilla(model, ids)
        v = time.perf_counter() - start
        with polykv.apply(model, plan) as session, _Timed(ProbePass, "run_chunks") as probe, \
                _Timed(kvzip, "reconstruction_scores") as scoring, _Timed(kvzip, "attend_and_score") as fused:
            start = time.perf_counter()
            _kvzip(session, ids)
            k = time.perf_counter() - start
    rest = k - probe.seconds
    print(f"breakdown at {T} tokens (threads {torch.get_num_threads()}), in units of the vanilla prefill ({v:.2f} s): "
          f"kvzip {k / v:.2f}x = prompt forward and selection {rest / v:.2f}x + probe forwards "
          f"{(probe.seconds - scoring.seconds - fused.seconds) / v:.2f}x + probe attention with its scoring "
          f"{fused.seconds / v:.2f}x + separate scoring {scoring.seconds / v:.2f}x")


def time_run(T: int, repeats: int) -> None:
    """Vanilla and kvzip prefills of T tokens, alternating, ``repeats`` times each; the best wall and CPU times."""
    import polykv

    model, ids, plan = _setup(T)
    wall = {"vanilla": [], "kvzip": []}
    cpu = {"vanilla": [], "kvzip": []}
    busiest = {"vanilla": [], "kvzip": []}
    probe = 0
    with torch.no_grad():
        _vanilla(model, ids[:, :256])  # warm-up
    with torch.no_grad():
        for _ in range(repeats):
            start, start_cpu, threads = time.perf_counter(), time.process_time(), _thread_cpu()
            _vanilla(model, ids)
            wall["vanilla"].append(time.perf_counter() - start)
            cpu["vanilla"].append(time.process_time() - start_cpu)
            busiest["vanilla"].append(_busiest(threads))
            with polykv.apply(model, plan) as session:
                start, start_cpu, threads = time.perf_counter(), time.process_time(), _thread_cpu()
                probe = _kvzip(session, ids)
                wall["kvzip"].append(time.perf_counter() - start)
                cpu["kvzip"].append(time.process_time() - start_cpu)
                busiest["kvzip"].append(_busiest(threads))
    v, k = min(wall["vanilla"]), min(wall["kvzip"])
    vc, kc = min(cpu["vanilla"]), min(cpu["kvzip"])
    print(f"time at {T} tokens (threads {torch.get_num_threads()}, best of {repeats}): vanilla prefill {v:.2f} s, "
          f"kvzip prefill {k:.2f} s (probe: {probe} extra forward tokens), ratio {k / v:.2f}x; CPU time: vanilla "
          f"{vc:.2f} s, kvzip {kc:.2f} s, ratio {kc / vc:.2f}x")
    vb, kb = min(busiest["vanilla"]), min(busiest["kvzip"])
    if torch.get_num_threads() > 1 and vb > 0:
        print(f"busiest thread's CPU time (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}): vanilla "
              f"{vb:.2f} s, kvzip {kb:.2f} s, ratio {kb / vb:.2f}x")


def memory_run(T: int) -> None:
    peak_memory.compare(__file__, T, "kvzip", ["--memory-tokens", str(T)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-tokens", type=int, default=None)
    parser.add_argument("--memory-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--breakdown", type=int, default=None, metavar="TOKENS",
                        help="time the probe's forwards and its scoring inside one kvzip prefill of TOKENS tokens")
    parser.add_argument("--child", choices=("vanilla", "kvzip"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.memory_tokens)
        return 0
    if args.time_tokens:
        time_run(args.time_tokens, args.repeats)
    if args.breakdown:
        breakdown_run(args.breakdown)
    if args.memory_tokens:
        memory_run(args.memory_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
