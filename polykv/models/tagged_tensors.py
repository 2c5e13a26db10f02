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
                fix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name as float32, metadata) of the safetensors file ``path`` written with format ``fmt``."""
    path = os.fspath(path)
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            arrays = {n: fh.get_tensor(n).float() for n in names}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on a damaged or foreign file
        raise ProfileError(f"{path}: not a readable {what} file ({type(exc).__name__}); {fix}") from None
    if meta.get("format") != fmt or meta.get("format_version") != str(version):
        raise ProfileError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r} is not "
                           f"{fmt!r} version {version}; {fix}")
    return arrays, meta
