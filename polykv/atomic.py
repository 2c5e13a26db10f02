"""Safe file writes: atomic replacement, stale temp-file cleanup, and output-path checks.

Every file polykv writes goes through a temp file beside the target (``.tmp-<pid>-<random>-<name>``),
fsync, then a rename over the target, so a crash never leaves a half-written file. A process killed
before the rename leaves its temp file behind; the next write into that folder removes temp files
whose process is gone (same host; the pid is in the name).

:func:`check_output` is what every CLI verb calls before it writes: it refuses an output path that
is one of the command's inputs (symlinks resolved), a folder, or an existing file of another kind
than the one the command writes (a file polykv did not create), so no command destroys a user's file.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from typing import Callable, Iterable

from polykv.errors import OutputError

_TMP = re.compile(r"^\.tmp-(\d+)-[0-9a-f]{8}-")


def temp_path(path: str) -> str:
    """A fresh temp-file path beside ``path`` whose name records this process's pid."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".tmp-{os.getpid()}-{secrets.token_hex(4)}-{name}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale_temps(folder: str) -> list[str]:
    """Remove ``.tmp-<pid>-...`` files in ``folder`` left by processes that no longer run; return them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def replace_with(path: str, write: Callable[[str], None]) -> None:
    """Write ``path`` atomically: ``write(tmp)`` fills a temp file beside it, which is then fsynced and
    renamed over ``path``. On any failure the previous file is left untouched and the temp file removed.

    The new file gets the replaced file's permission bits, or those of a plain new file (0o666 less the umask)
    when there was none: a writer that creates private files (safetensors' does, 0o600) does not make a shared
    profile or plan unreadable to others."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    clean_stale_temps(folder)
    tmp = temp_path(path)
    try:
        write(tmp)
        if os.path.isfile(tmp):
            os.chmod(tmp, _mode_for(path))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _mode_for(path: str) -> int:
    """Permission bits a replacement of ``path`` gets: the existing file's, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_text_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text``; on any failure the previous file is left untouched."""
    def write(tmp: str) -> None:
        with open(tmp, "x", encoding="utf-8", newline="\n") as fh:
            fh.write(text)

    replace_with(path, write)


def append_line_durable(path: str, line: str) -> None:
    """Append one line (a JSONL record) and fsync, so a crash never loses a finished record."""
    with open(path, "a", encoding="utf-8", newline="\n") as fh:
        fh.write(line.rstrip("\n") + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# -- output-path checks ---------------------------------------------------------------------------

def same_file(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name the same file (symlinks and ``..`` resolved)."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if ra == rb:
        return True
    try:
        return os.path.samefile(ra, rb)
    except OSError:
        return False


def check_output(path: str, *, what: str, option: str, inputs: Iterable[str] = (),
                 recognise: Callable[[str], bool] | None = None, folder: bool = False) -> None:
    """Refuse to write ``path`` when that would destroy something that is not ours to replace.

    Parameters
    ----------
    path : str
        The output path the user gave.
    what : str
        What the command writes there (``"plan file"``), for the message.
    option : str
        The option or argument that named it (``"-o"``), for the message.
    inputs : iterable of str
        Paths the command reads; the output may be none of them (symlinks resolved).
    recognise : callable, optional
        ``recognise(existing_path) -> bool``: True when an existing file is one this command wrote
        before (then it may be replaced). Without it, any existing file is refused.
    folder : bool
        The output is a folder (``report -o DIR``): an existing folder is fine, a file is not.

    Raises
    ------
    OutputError
        One line naming the path and what to do.
    """
    path = os.fspath(path)
    if not path:
        raise OutputError(f"{option}: empty output path; give a file name")
    for src in inputs:
        if src and same_file(path, src):
            raise OutputError(f"{option} {path}: this is also an input of the command ({src}); writing the "
                              f"{what} there would destroy it. Choose another output path")
    if os.path.lexists(path) and not os.path.exists(path):
        raise OutputError(f"{option} {path}: a dangling or looping symbolic link; remove it or choose another "
                          f"output path")
    if folder:
        if os.path.exists(path) and not os.path.isdir(path):
            raise OutputError(f"{option} {path}: exists and is not a folder; the {what} is a folder. Choose "
                              f"another output path")
        return
    if os.path.isdir(path):
        raise OutputError(f"{option} {path}: is a folder; give a file path for the {what}")
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise OutputError(f"{option} {path}: not a regular file; choose another output path")
        if recognise is None or not _recognised(recognise, path):
            raise OutputError(f"{option} {path}: an existing file that is not a {what} polykv wrote; refusing "
                              f"to replace it. Choose another output path (or move that file away)")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise OutputError(f"{option} {path}: {parent} is not a folder; choose another output path")


def _recognised(recognise: Callable[[str], bool], path: str) -> bool:
    try:
        return bool(recognise(path))
    except Exception:  # unreadable or malformed: not a file this command wrote
        return False


# -- lock files -----------------------------------------------------------------------------------

LOCK_MAGIC = b"polykv lock file (safe to remove when no polykv command is running)\n"
"""First line of every lock file polykv creates: how an existing lock file is known to be ours."""

_LEGACY_HOLDER = re.compile(rb"^pid \d+ on host \S+ since \S+\n?$")
"""What older polykv versions left in a lock file held when its process was killed (no first line)."""


class LockBusy(OutputError):
    """Another process holds the lock; ``holder`` is what it recorded (pid, host, since when)."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class FileLock:
    """An exclusive advisory lock (``fcntl.flock``) on a lock file polykv created itself.

    A lock file is created exclusively, already locked and holding :data:`LOCK_MAGIC` (written to a
    temp file that is hard-linked into place, so no other process ever sees it empty or unlocked). An
    existing lock file is opened without following symbolic links and used only when it is a regular
    file that starts with :data:`LOCK_MAGIC`; anything else (a user's file, a symlink, a FIFO, a
    folder) is refused and left exactly as it was. The file stays after release (removing it would
    race with a process about to lock it); a released lock records no holder. The lock itself goes with
    the process, also when it is killed.
    """

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, path: str, *, record: bool = True, what: str = "lock file") -> "FileLock":
        """Lock ``path`` (creating it when absent); raise :class:`LockBusy` when another process holds it,
        :class:`OutputError` when ``path`` exists as anything but a polykv lock file."""
        import fcntl

        path = os.fspath(path)
        for _ in range(8):  # each retry means another process created or replaced the file meanwhile
            fd = _open_lock(path, what)
            if fd is None:
                fd = _create_lock(path, what)
                if fd is None:
                    continue
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    holder = _holder(fd)
                    os.close(fd)
                    raise LockBusy(f"{path}: held by another process ({holder})", holder) from None
                try:
                    now = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is None or now.st_ino != os.fstat(fd).st_ino:
                    os.close(fd)
                    continue
                head = os.pread(fd, 4096, 0)
                if not head.startswith(LOCK_MAGIC) and not _LEGACY_HOLDER.match(head):
                    os.close(fd)
                    hint = ("an empty file; an older polykv left its released locks empty: remove the file if it "
                            "is one" if not head else "polykv will not change it; move it away")
                    raise OutputError(f"{path}: exists and is not a {what} polykv created ({hint}), or choose "
                                      "another path")
            lock = cls(path, fd)
            if record:
                lock._record()
            return lock
        raise OutputError(f"{path}: the {what} keeps being replaced by another process; try again")

    def _record(self) -> None:
        import socket
        import time

        holder = (f"pid {os.getpid()} on host {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, LOCK_MAGIC + holder.encode(), 0)

    def release(self, clear: bool = True) -> None:
        """Unlock; with ``clear`` the file keeps only its first line (no holder)."""
        import fcntl

        if self.fd is None:
            return
        if clear:
            try:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, LOCK_MAGIC, 0)
            except OSError:
                pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def lock_file_itself(path: str, what: str, *, create: bool = False, probe: bool = False) -> int | None:
    """An fd of the regular file ``path`` holding an advisory lock (``fcntl.flock``) on the file itself, so every
    name of it (a hard link, a symlink, another mount) meets the same lock; None when ``path`` does not exist
    (created empty first with ``create``). ``probe`` takes a shared lock, only to learn that nobody holds it.

    Raises :class:`LockBusy` when another open of the file holds the lock (in this process too), and
    :class:`OutputError` when ``path`` cannot be opened or is not a regular file.
    """
    import fcntl

    flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
             | (os.O_CREAT if create else 0))
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"{path}: cannot open the {what} ({exc.strerror}); choose another path") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"{path}: not a regular file (a pipe, socket or device); choose another path for the "
                              f"{what}")
        fcntl.flock(fd, (fcntl.LOCK_SH if probe else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockBusy(f"{path}: another process holds the {what}", "holder unknown") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_error(path: str, what: str, exc: OSError) -> OutputError:
    import errno

    if exc.errno == errno.ELOOP:
        return OutputError(f"{path}: a symbolic link where polykv keeps its {what}; polykv will not follow it or "
                           "change what it points to. Remove the link, or choose another path")
    if exc.errno == errno.EISDIR:
        return OutputError(f"{path}: a folder where polykv keeps its {what}; move it away, or choose another path")
    return OutputError(f"{path}: cannot open the {what} ({exc.strerror}); choose a writable folder")


def _open_lock(path: str, what: str) -> int | None:
    """An fd of the existing regular file ``path`` (never through a symlink), or None when there is none."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: not a regular file (a pipe, socket or device) where polykv keeps its {what}; "
                          "move it away, or choose another path")
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _lock_error(path, what, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(f"{path}: not a regular file (a pipe, socket or device) where polykv keeps its {what}; "
                          "move it away, or choose another path")
    return fd


def _create_lock(path: str, what: str) -> int | None:
    """Create ``path`` exclusively, already locked and holding :data:`LOCK_MAGIC`; None when it appeared."""
    import errno
    import fcntl

    tmp = temp_path(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        raise _lock_error(path, what, exc) from None
    try:
        os.write(fd, LOCK_MAGIC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else can hold it
        try:
            os.link(tmp, path)  # fails when anything exists at path, a symlink included
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise _lock_error(path, what, exc) from None
            os.close(fd)  # a file system without hard links: create the file itself exclusively
            fd = -1
            try:
                fd = os.open(path, flags, 0o644)
            except FileExistsError:
                return None
            except OSError as exc2:
                raise _lock_error(path, what, exc2) from None
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, LOCK_MAGIC)
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0)
    except OSError:
        text = b""
    if text.startswith(LOCK_MAGIC):
        text = text[len(LOCK_MAGIC):]
    return text.decode("utf-8", "replace").strip() or "holder unknown"
