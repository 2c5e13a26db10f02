"""The lock a study holds on its results file while it writes it (:class:`ResultsLock`), so that no two runs append
to one file, whatever names they reach it by."""

from __future__ import annotations

import os

from polykv.atomic import FileLock, LockBusy, lock_file_itself
from polykv.errors import OutputError, StudyError


class ResultsLock:
    """An exclusive advisory lock on ``<results>.lock`` beside the resolved results path, naming its holder, and
    on the results file itself.

    The lock file is keyed by the results file's resolved path, so a symlink to a results file and the
    file itself share one lock. See :class:`polykv.atomic.FileLock`: the lock file is created
    exclusively, never followed through a symlink, and an existing file that is not a polykv lock is
    refused untouched. The lock on the results file's own descriptor (:func:`polykv.atomic.lock_file_itself`)
    is what every other name of the file meets too: a hard link, a path through another mount.
    """

    def __init__(self, path: str, lock: FileLock, fd: int | None = None, created: str | None = None):
        self.path, self._lock, self._fd = path, lock, fd
        self.created = created
        """The results file when this lock created it (empty), else None."""

    @staticmethod
    def lock_path(results: str) -> str:
        return os.path.realpath(results) + ".lock"

    @classmethod
    def acquire(cls, results: str, *, record: bool = True) -> "ResultsLock":
        path = cls.lock_path(results)
        try:
            lock = FileLock.acquire(path, record=record, what="results lock file")
        except LockBusy as exc:
            raise StudyError(f"{results}: another polykv study is writing this results file ({exc.holder}); wait "
                             "for it to finish, or pass another --results path") from None
        except OutputError as exc:
            raise StudyError(f"{exc} (--results {results})") from None
        try:
            existed = os.path.exists(results)
            fd = _lock_results_file(results, create=record)
        except BaseException:
            lock.release(clear=record)
            raise
        return cls(path, lock, fd, None if existed or fd is None else results)

    @classmethod
    def probe(cls, results: str) -> None:
        """Raise the lock's StudyError when another process holds it (or the lock file is not ours);
        hold nothing afterwards."""
        if os.path.lexists(cls.lock_path(results)):
            cls.acquire(results, record=False).release(clear=False)
        fd = _lock_results_file(results, create=False, probe=True)
        if fd is not None:
            os.close(fd)

    def release(self, clear: bool = True) -> None:
        """Unlock; a results file this lock created and nothing was written into is removed first."""
        if self.created is not None:
            try:
                if os.path.getsize(self.created) == 0:
                    os.unlink(self.created)
            except OSError:
                pass
            self.created = None
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of this open releases its flock
            self._fd = None
        self._lock.release(clear=clear)


def _lock_results_file(results: str, *, create: bool, probe: bool = False) -> int | None:
    try:
        return lock_file_itself(results, "results file", create=create, probe=probe)
    except LockBusy:
        raise StudyError(f"{results}: another polykv run holds this results file (open under another name: a hard "
                         "link or other alias of it); wait for it to finish, or pass another --results path") from None
    except OutputError as exc:
        raise StudyError(f"{exc} (--results {results})") from None
