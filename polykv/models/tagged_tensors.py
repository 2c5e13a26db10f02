"""Per-model data files: named tensors in one safetensors file whose metadata carries a format tag and version.

:func:`read_tagged` reads one back and refuses, in one line naming the file, a file that is not readable or
carries another format or version (``what`` names the data, ``fix`` says what to do).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from polykv.errors import ProfileError


def read_tagged(path: str | os.PathLike, names: Sequence[str], *, fmt: str, version: int, what: str,
                fix: str, nonnegative: Sequence[str] = ()) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name as float32, metadata) of the safetensors file ``path`` written with format ``fmt``.

    Refused in one line naming the tensor: a file that is not a regular file (checked before it is opened), a
    tensor of an integer dtype, a NaN or infinite value, a negative value in a tensor of ``nonnegative``."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise ProfileError(f"{path}: not a regular file (a FIFO, device or folder); name a {what} file")
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            raw = {n: fh.get_tensor(n) for n in names}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on a damaged or foreign file
        raise ProfileError(f"{path}: not a readable {what} file ({type(exc).__name__}); {fix}") from None
    if meta.get("format") != fmt or meta.get("format_version") != str(version):
        raise ProfileError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r} is not "
                           f"{fmt!r} version {version}; {fix}")
    check_tensors(path, raw, fix=fix, nonnegative=nonnegative)
    return {n: t.float() for n, t in raw.items()}, meta


def check_tensors(path: str, arrays: dict[str, torch.Tensor], *, fix: str, nonnegative: Sequence[str] = ()) -> None:
    """Refuse, in one line naming ``path`` and the tensor, an integer dtype, a NaN or infinite value, or a negative
    value in a tensor of ``nonnegative``: the content check every per-model data file gets when it is loaded."""
    for name, tensor in arrays.items():
        if not tensor.is_floating_point():
            raise ProfileError(f"{path}: tensor '{name}' has dtype {tensor.dtype}, not a floating dtype; {fix}")
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ProfileError(f"{path}: tensor '{name}' holds {bad} NaN or infinite values; {fix}")
        if name in nonnegative and bool((tensor < 0).any()):
            raise ProfileError(f"{path}: tensor '{name}' holds negative values (min {float(tensor.min()):.3g}), "
                               f"which it cannot; {fix}")
