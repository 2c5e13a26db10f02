"""Per-layer checkpoints of a calibration run, so an interrupted run resumes where it stopped.

The folder ``<output>.partial/`` beside the profile holds ``run.json`` (a digest of everything the
results depend on: model fingerprint, token ids, configs, settings) and one ``layer-NNN.npz`` per
finished layer, each written atomically (temp file + rename). A run with the same digest loads the
finished layers and computes only the others; a different digest is an error rather than a silent
restart. ``run.json`` also carries polykv's marker (``format``): a folder without it, a symlink or a
file at that path is never used, written into or deleted. Once the profile is written, the files a
run wrote are removed, then the folder (when nothing else is in it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import zipfile
from typing import Any

import numpy as np

from polykv.atomic import clean_stale_temps, replace_with, temp_path, write_text_atomic
from polykv.errors import ProfileError
from polykv.strict_json import JsonInputError, loads_strict


def run_digest(parts: Any) -> str:
    """sha256 (first 16 hex digits) of a JSON-serialisable description of a run."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


FORMAT = "polykv-calibration-checkpoint"
"""``run.json``'s ``format``: the marker that proves a checkpoint folder is one polykv created."""

_LAYER = re.compile(r"^layer-\d{3,}\.npz$")
_DIGEST = re.compile(r"^[0-9a-f]{16}$")


def _not_ours(folder: str, why: str) -> ProfileError:
    return ProfileError(f"{folder}: exists and is not a calibration checkpoint folder polykv created ({why}); polykv "
                        "will neither use nor delete it. Move it away, or choose another -o")


def folder_digest(folder: str | os.PathLike) -> str | None:
    """The run digest of the checkpoint folder ``folder``; None when there is none.

    Raises ProfileError when something else is there: a symlink (never followed), a file, or a folder
    whose ``run.json`` is missing, unreadable or not polykv's marker.
    """
    folder = os.fspath(folder)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _not_ours(folder, "a symbolic link; polykv keeps checkpoints only in a folder it created itself")
    if not stat.S_ISDIR(st.st_mode):
        raise _not_ours(folder, "not a folder")
    meta = os.path.join(folder, "run.json")
    try:
        mst = os.lstat(meta)
    except FileNotFoundError:
        raise _not_ours(folder, "it holds no run.json") from None
    if not stat.S_ISREG(mst.st_mode):
        raise _not_ours(folder, "its run.json is not a regular file")
    if mst.st_size > 1 << 16:
        raise _not_ours(folder, f"its run.json holds {mst.st_size} bytes")
    try:
        with open(meta, "rb") as fh:
            raw = loads_strict(fh.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise _not_ours(folder, f"{meta} is not UTF-8 text") from None
    except JsonInputError as exc:
        raise _not_ours(folder, f"{meta} is not valid JSON: {exc}") from None
    ours = isinstance(raw, dict) and isinstance(raw.get("digest"), str) and _DIGEST.match(raw["digest"]) and (
        raw.get("format") == FORMAT and set(raw) == {"format", "digest"} or set(raw) == {"digest"})  # older runs
    if not ours:
        raise _not_ours(folder, f"{meta} is not the run record polykv writes")
    return raw["digest"]


class Checkpoint:
    """Finished layers of one run in ``folder`` (None = no checkpointing).

    The folder is created (with its ``run.json`` marker, under a temp name renamed into place) when it
    does not exist; an existing one is used only when :func:`folder_digest` proves it is ours and of
    this very run.
    """

    def __init__(self, folder: str | os.PathLike | None, digest: str):
        self.folder = None if folder is None else os.fspath(folder)
        self.digest = digest
        if self.folder is None:
            return
        theirs = folder_digest(self.folder)
        if theirs is None:
            self._create()
        elif theirs != digest:
            raise ProfileError(
                f"{self.folder}: holds partial results of a different calibration run (digest {theirs}, this run "
                f"{digest}: another model, corpus, config list or setting); rerun with the same settings to "
                f"resume, or delete the folder to start over")

    def _create(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.folder))
        os.makedirs(parent, exist_ok=True)
        clean_stale_temps(parent)
        tmp = temp_path(self.folder)
        os.mkdir(tmp)
        try:
            write_text_atomic(os.path.join(tmp, "run.json"),
                              json.dumps({"format": FORMAT, "digest": self.digest}) + "\n")
            if os.path.lexists(self.folder):  # appeared meanwhile: never replace it
                raise _not_ours(self.folder, "it appeared while this run was creating it")
            os.rename(tmp, self.folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _path(self, layer: int) -> str:
        return os.path.join(self.folder, f"layer-{layer:03d}.npz")

    def load(self, layer: int, required: tuple[str, ...] = ()) -> dict[str, np.ndarray] | None:
        """The saved arrays of ``layer``, or None when it is not finished; a ProfileError naming the file
        when it is damaged (unreadable, not an ``.npz``, or without one of the ``required`` arrays)."""
        if self.folder is None:
            return None
        path = self._path(layer)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        fix = f"delete it to compute layer {layer} again"
        if not stat.S_ISREG(st.st_mode):
            raise ProfileError(f"{path}: not a regular file where a calibration checkpoint belongs; {fix}")
        try:
            with np.load(path, allow_pickle=False) as fh:
                arrays = {k: fh[k].copy() for k in fh.files}
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
            why = "an empty file" if st.st_size == 0 else f"{type(exc).__name__}: {exc}"
            raise ProfileError(f"{path}: a damaged calibration checkpoint ({why}); {fix}") from None
        missing = [k for k in required if k not in arrays]
        if missing:
            raise ProfileError(f"{path}: a damaged calibration checkpoint (no array {missing[0]!r}); {fix}")
        return arrays

    def save(self, layer: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``layer``'s arrays atomically."""
        if self.folder is None:
            return
        def write(tmp: str) -> None:
            with open(tmp, "xb") as fh:
                np.savez(fh, **{k: np.asarray(v) for k, v in arrays.items()})

        replace_with(self._path(layer), write)

    def remove(self) -> list[str]:
        """Delete the folder (after the profile was written); see :func:`remove_folder`."""
        return remove_folder(self.folder) if self.folder is not None else []


def remove_folder(folder: str | os.PathLike) -> list[str]:
    """Delete a checkpoint folder once its profile is written: only the files a calibration run writes
    there (``run.json``, ``layer-NNN.npz``, temp files of finished processes), then the folder if that
    leaves it empty. Returns the names of anything else found (then the folder stays). Nothing happens
    when the folder is absent or is not one :func:`folder_digest` recognises."""
    folder = os.fspath(folder)
    try:
        if folder_digest(folder) is None:
            return []
    except ProfileError:
        return []
    clean_stale_temps(folder)
    others = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if (_LAYER.match(name) or name == "run.json") and os.path.isfile(path) and not os.path.islink(path):
            if name != "run.json":
                os.unlink(path)
        else:
            others.append(name)
    if others:
        return others
    os.unlink(os.path.join(folder, "run.json"))
    os.rmdir(folder)
    return []
