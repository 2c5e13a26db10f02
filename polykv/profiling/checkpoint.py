"""Per-layer checkpoints of a calibration run, so an interrupted run resumes where it stopped.

The folder ``<output>.partial/`` beside the profile holds ``run.json`` (a digest of everything the
results depend on: model fingerprint, token ids, configs, settings) and one ``layer-NNN.npz`` per
finished layer, each written atomically (temp file + rename). A run with the same digest loads the
finished layers and computes only the others; a different digest is an error rather than a silent
restart. The folder is removed once the profile is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from polykv.atomic import write_text_atomic
from polykv.errors import ProfileError


def run_digest(parts: Any) -> str:
    """sha256 (first 16 hex digits) of a JSON-serialisable description of a run."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Checkpoint:
    """Finished layers of one run in ``folder`` (None = no checkpointing)."""

    def __init__(self, folder: str | os.PathLike | None, digest: str):
        self.folder = None if folder is None else os.fspath(folder)
        self.digest = digest
        if self.folder is None:
            return
        meta = os.path.join(self.folder, "run.json")
        if os.path.exists(meta):
            with open(meta, encoding="utf-8") as fh:
                theirs = json.load(fh).get("digest")
            if theirs != digest:
                raise ProfileError(
                    f"{self.folder}: holds partial results of a different calibration run (digest {theirs}, this run "
                    f"{digest}: another model, corpus, config list or setting); rerun with the same settings to "
                    f"resume, or delete the folder to start over")
        else:
            os.makedirs(self.folder, exist_ok=True)
            write_text_atomic(meta, json.dumps({"digest": digest}) + "\n")

    def _path(self, layer: int) -> str:
        return os.path.join(self.folder, f"layer-{layer:03d}.npz")

    def load(self, layer: int) -> dict[str, np.ndarray] | None:
        """The saved arrays of ``layer``, or None when it is not finished."""
        if self.folder is None or not os.path.exists(self._path(layer)):
            return None
        with np.load(self._path(layer), allow_pickle=False) as fh:
            return {k: fh[k].copy() for k in fh.files}

    def save(self, layer: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``layer``'s arrays atomically."""
        if self.folder is None:
            return
        from polykv.atomic import replace_with

        def write(tmp: str) -> None:
            with open(tmp, "xb") as fh:
                np.savez(fh, **{k: np.asarray(v) for k, v in arrays.items()})

        replace_with(self._path(layer), write)

    def remove(self) -> None:
        """Delete the folder (after the profile was written)."""
        if self.folder is not None:
            remove_folder(self.folder)


def remove_folder(folder: str | os.PathLike) -> None:
    """Delete a checkpoint folder once its profile is written (no error when it is absent)."""
    if os.path.isdir(folder):
        shutil.rmtree(folder)
