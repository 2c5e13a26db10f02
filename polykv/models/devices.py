"""The one check of a ``--device`` / ``--dtype`` pair every verb runs before it loads a model, and of ``--threads``.

``calibrate``, ``solve --solver refine``, ``model-data`` and the lm-eval model's ``device=`` / ``dtype=`` all
call :func:`check_device`, so a device this machine lacks (``cuda`` without CUDA, ``cuda:3`` on a one-GPU
machine, ``mps`` off a Mac), a name that is no torch device (``tpu9``), the ``meta`` device (no data: a model
there cannot run) or an unknown dtype is one line naming the option, before any weights are read.

>>> check_device("cpu", "bf16")
'bfloat16'
"""

from __future__ import annotations

import os

import torch

from polykv.errors import PolykvError, StudyError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
"""Accepted spellings of the model dtype, to the torch name."""


def dtype_name(value, *, option: str = "--dtype", error: type[PolykvError] = PolykvError) -> str:
    """The torch name (float32, bfloat16, float16) of a dtype spelling or ``torch.dtype``; else ``error``."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str) or value not in DTYPES:
        raise error(f"{option} {value!r}: use float32, bfloat16 (bf16) or float16 (fp16)")
    return DTYPES[value]


def check_device(device, dtype="float32", *, device_option: str = "--device", dtype_option: str = "--dtype",
                 error: type[PolykvError] = PolykvError, half_on_cpu: bool = True) -> str:
    """Check that ``device`` exists on this machine and ``dtype`` is a model dtype; returns the dtype's torch name.

    ``half_on_cpu=False`` also refuses float16 on the CPU (calibration: CPU half-precision kernels are slow and
    incomplete). The options' names (``device_option``, ``dtype_option``) are those the messages cite."""
    name = dtype_name(dtype, option=dtype_option, error=error)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise error(f"{device_option} {device!r}: not a torch device (use cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise error(f"{device_option} {device}: CUDA is not available on this machine (torch {torch.__version__}); "
                    f"use {device_option} cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise error(f"{device_option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise error(f"{device_option} {device}: MPS is not available on this machine; use {device_option} cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise error(f"{device_option} {device}: polykv runs models on cpu, cuda or mps, not {dev.type}")
    if dev.type == "cpu" and name == "float16" and not half_on_cpu:
        raise error(f"{dtype_option} float16 on {device_option} cpu: CPU half-precision kernels are slow and "
                    "incomplete; use float16 on a GPU, or bfloat16 or float32 on the CPU")
    return name


REMOTE_THREADS_MAX = 1024
"""Most ``--threads`` a Ray worker (on a machine this process cannot see) may be asked for."""


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(n: int | None, error=None, *, remote: bool = False) -> None:
    """``--threads`` lies in 1..(CPUs of this machine), checked before anything is written: torch accepts
    any number, and a number past what the OS lets one process start aborts the process later (libgomp)."""
    if n is None:
        return
    error = error or StudyError
    high = REMOTE_THREADS_MAX if remote else cpu_count()
    if not 1 <= n <= high:
        where = "per Ray worker" if remote else f"this machine gives this process {high} CPU(s)"
        raise error(f"--threads {n}: give a whole number from 1 to {high} ({where}; more threads than CPUs only "
                    "slow torch down)")
