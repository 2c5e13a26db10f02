"""Decode attention straight from KIVI codes on the CPU: a small C kernel, compiled on first use.

Reading the 4-bit codes instead of a 16- or 32-bit cache pays at long context only if the codes are read
once, unpacked into registers and folded into the scores and the value sum in the same pass
(:mod:`kivi_cpu_source` says how). Torch ops cannot do that without writing the unpacked tensor out, so the
kernel is C, built with the system C compiler (``cc``, or ``$CC``) the first time a CPU decode asks for
it (never at import) and cached by source, flags and CPU under ``$POLYKV_CACHE/kernels`` (default
``~/.cache/polykv/kernels``). It runs on ``torch.get_num_threads()`` POSIX threads.

Where it cannot be built (no compiler, a failed build, a cache folder that cannot be written) a single
:class:`KernelUnavailableWarning` line says why, once, and decode reads the codes blockwise in torch
(``polykv.attention.online_softmax.blockwise_attention``, the same attention, slower).
``POLYKV_KIVI_CPU_KERNEL=0`` turns the kernel off (the blockwise path, no warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import torch

from polykv.contract import model_data
from polykv.errors import PolykvWarning, RuntimeConfigError
from polykv.adapters.quantizers.kivi_cpu_source import SOURCE

ENV_SWITCH = "POLYKV_KIVI_CPU_KERNEL"
"""Set to ``0`` to turn the compiled CPU decode kernel off."""
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros")
LAYOUT_CODE = {"none": 0, "channel": 1, "token": 2}
MIN_SPLIT = 256
"""Fewest tokens a thread's share of one head holds (smaller splits cost more in merging than they save)."""


SWITCH_VALUES = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False,
                 "no": False}


class KernelUnavailableWarning(PolykvWarning):
    """The compiled CPU decode kernel cannot be built here; decode reads the codes blockwise in torch."""


class _Stream(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("codes", "scale", "zero", "gid", "res")]
                + [(n, ctypes.c_int64) for n in ("c_b", "c_h", "c_t", "s_b", "s_h", "s_t", "g_b", "g_h", "g_t",
                                                 "r_b", "r_h", "r_t")]
                + [("nq", ctypes.c_void_p), ("nr", ctypes.c_void_p), ("nq_all", ctypes.c_int64), ("nr_all", ctypes.c_int64)]
                + [(n, ctypes.c_int32) for n in ("layout", "bits", "group", "pad")])


class _Job(ctypes.Structure):
    _fields_ = ([("q", ctypes.c_void_p), ("out", ctypes.c_void_p), ("k", _Stream), ("v", _Stream)]
                + [(n, ctypes.c_int64) for n in ("B", "H", "M", "qlen", "d", "dv", "nsplit", "chunk", "nthreads")]
                + [("scaling", ctypes.c_float), ("next", ctypes.c_int32)]
                + [(n, ctypes.c_void_p) for n in ("pm", "pl", "pacc")])


_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why it cannot be built


def enabled() -> bool:
    """Whether the kernel is wanted: ``POLYKV_KIVI_CPU_KERNEL`` unset or 1/on/true/yes (0/off/false/no: not)."""
    raw = os.environ.get(ENV_SWITCH) or "1"  # unset or empty: on
    value = SWITCH_VALUES.get(raw.strip().lower())
    if value is None:
        raise RuntimeConfigError(f"environment variable {ENV_SWITCH}={raw!r} is not a switch; set it to 1 (use the "
                                 f"compiled CPU decode kernel) or 0 (read the codes blockwise in torch), or unset it")
    return value


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's flags (a cached build never runs on another CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def library_path(compiler: str) -> str:
    """Where the build for this source, these flags, this compiler and this CPU is cached."""
    key = hashlib.sha256("\0".join((SOURCE, " ".join(FLAGS), compiler, _cpu_id())).encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(model_data.cache_dir()), "kernels", f"kivi_cpu-{key}.so")


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    exe = shutil.which(compiler)
    if exe is None:
        raise OSError(f"no C compiler: {compiler!r} is not on PATH (install gcc or set CC)")
    path = library_path(exe)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            src, lib = os.path.join(tmp, "kivi_cpu.c"), os.path.join(tmp, "kivi_cpu.so")
            with open(src, "w") as f:
                f.write(SOURCE)
            done = subprocess.run([exe, *FLAGS, src, "-o", lib, "-lm"], capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise OSError(f"{compiler} failed ({last})")
            os.replace(lib, path)  # atomic: a concurrent build never leaves half a library
    lib = ctypes.CDLL(path)
    lib.kivi_decode.argtypes = [ctypes.POINTER(_Job)]
    lib.kivi_decode.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on the first call; None (after one warning line) where it cannot be built."""
    with _lock:
        if not _state:
            try:
                _state["lib"] = _build()
            except (OSError, subprocess.SubprocessError) as e:
                _state["error"] = str(e)
                warnings.warn(f"polykv: the compiled KIVI CPU decode kernel is unavailable: {e}; decode reads the "
                              f"codes blockwise in torch (slower; set {ENV_SWITCH}=0 to silence this)",
                              KernelUnavailableWarning, stacklevel=3)
        return _state.get("lib")


def ready(query: torch.Tensor) -> bool:
    """Whether the kernel runs for ``query``: a CPU query, the kernel wanted and built."""
    return query.device.type == "cpu" and enabled() and library() is not None


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 with a contiguous last dim (no copy when it already is)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _stream(view, keep: list) -> _Stream:
    """The C description of one token-blocks view; tensors the kernel reads are kept alive in ``keep``."""
    s = _Stream(layout=LAYOUT_CODE[view.layout], bits=view.bits, group=max(int(getattr(view, "group_size", 1)), 1))
    res = _float_rows(view.residual)
    keep.append(res)
    s.res = res.data_ptr()
    if view.ragged:   # counts per head; otherwise every head holds the same, passed by value
        nq, nr = (c.to(torch.int64).contiguous() for c in view.head_counts())
        keep += [nq, nr]
        s.nq, s.nr = nq.data_ptr(), nr.data_ptr()
    else:
        s.nq_all, s.nr_all = view.num_quantized, res.shape[2]
    s.r_b, s.r_h, s.r_t = res.stride()[:3]
    if view.codes is not None:
        codes = view.codes if view.codes.stride(-1) == 1 else view.codes.contiguous()
        scale, zero = _float_rows(view.scale), _float_rows(view.zero)
        if scale.stride() != zero.stride():  # the kernel reads both with one set of strides
            scale, zero = scale.contiguous(), zero.contiguous()
        keep += [codes, scale, zero]
        s.codes, s.scale, s.zero = codes.data_ptr(), scale.data_ptr(), zero.data_ptr()
        s.c_b, s.c_h, s.c_t = codes.stride()[:3]
        s.s_b, s.s_h, s.s_t = scale.stride()[:3]
        gid = getattr(view, "group_ids", None)
        if gid is not None:
            gid = gid.to(torch.int32)
            keep.append(gid)
            s.gid = gid.data_ptr()
            s.g_b, s.g_h, s.g_t = gid.stride()[:3]
    return s


def _splits(heads: int, tokens: int, threads: int) -> int:
    """Splits of each head's tokens: about four work items per thread, and a whole number of items per thread
    where that takes no split under :data:`MIN_SPLIT` tokens (9 items on 2 threads leave one thread a fifth
    of the work to do alone at the end; 12 do not)."""
    most = max(1, -(-tokens // MIN_SPLIT))
    n = max(1, min(most, -(-4 * threads // heads)))
    for even in range(n, min(most, n + threads) + 1):
        if heads * even % threads == 0:
            return even
    return n


def decode_attention(query: torch.Tensor, keys, values, *, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, H, q, d] over token-blocks views ``keys`` [.., d] and ``values`` [.., dv] (KIVI
    codes or full-precision rows, ragged heads included): [B, H, q, dv] in the query's dtype.

    The same attention as ``polykv.attention.online_softmax.blockwise_attention`` (lower-right causal among
    the q new tokens, each head over its own length), computed in float32 from the codes.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled KIVI CPU decode kernel is unavailable: {_state.get('error')}")
    B, H, q, d = query.shape
    Hkv = keys.residual.shape[1]
    if H % Hkv or keys.residual.shape[0] != B or values.residual.shape[1] != Hkv:
        raise ValueError(f"query has batch {B} and {H} heads; the stores hold batch {keys.residual.shape[0]} and "
                         f"{Hkv} KV heads (query heads must be a multiple of KV heads)")
    if keys.head_dim != d:
        raise ValueError(f"queries of head dim {d} cannot attend over keys of head dim {keys.head_dim}")
    dv = values.head_dim
    k_len, v_len = keys.lengths, values.lengths
    kn = keys.padded_len if k_len is None else None
    if (k_len is None) != (v_len is None) or (k_len is None and kn != values.padded_len) or (
            k_len is not None and not torch.equal(k_len, v_len)):
        raise ValueError("keys and values disagree on the per-head lengths; a token must be kept or dropped in both")
    T = keys.padded_len
    shortest = T if k_len is None else int(k_len.min())
    if shortest < q:
        raise ValueError(f"attention over {shortest} stored tokens with {q} queries: the queries' own "
                         f"tokens must be stored (append them before attending)")
    M = (H // Hkv) * q
    rows = query.float().reshape(B, Hkv, M, d).contiguous()
    out = torch.empty(B, Hkv, M, dv, dtype=torch.float32)
    threads = max(1, torch.get_num_threads())
    nsplit = _splits(B * Hkv, T, threads)
    keep: list = []
    job = _Job(q=rows.data_ptr(), out=out.data_ptr(), k=_stream(keys, keep), v=_stream(values, keep), B=B, H=Hkv,
               M=M, qlen=q, d=d, dv=dv, nsplit=nsplit, chunk=-(-T // nsplit), nthreads=threads, scaling=float(scaling))
    if lib.kivi_decode(ctypes.byref(job)):
        raise MemoryError(f"the CPU decode kernel could not allocate its buffers ({B * Hkv * nsplit} splits of "
                          f"{M} rows x {d})")
    del keep
    return out.view(B, H, q, dv).to(query.dtype)
