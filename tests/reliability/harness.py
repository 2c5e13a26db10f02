"""Run a polykv command in-process on a prepared folder and classify what happened.

Classes (most severe last): ``clear`` (exit 2, one stderr line ``polykv VERB: error: ...`` naming the
expected field, nothing written), ``wrong`` (an error, but not that one line, or the field is not
named, or an output was left behind), ``silent`` (exit 0), ``traceback`` (an exception escaped or a
traceback was printed), ``data loss`` (a file that existed before changed or vanished), ``hang``
(no answer within the time limit).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
from pathlib import Path

CLASSES = ("clear", "wrong", "silent", "traceback", "data loss", "hang")
TIME_LIMIT_S = 60


class Hang(Exception):
    pass


def snapshot(folder: Path) -> dict[str, str]:
    """Every regular file under ``folder`` (symlinks and FIFOs skipped) with its sha256."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as fh:
                out[path] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run_cli(argv: list[str], cwd: Path) -> tuple[int | None, str, str, BaseException | None]:
    """(exit code, stdout, stderr, escaped exception) of ``polykv.cli.main(argv)`` run in ``cwd``."""
    from polykv.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()

    def alarm(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIME_LIMIT_S)
    exc = None
    code = None
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse --help and the like
                code = e.code if isinstance(e.code, int) else 2
    except BaseException as e:  # noqa: BLE001 - anything escaping main is what the test looks for
        exc = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(old)
    return code, out.getvalue(), err.getvalue(), exc


def classify(argv: list[str], cwd: Path, *, expect: str, outputs: tuple[str, ...] = ()) -> tuple[str, str]:
    """(class, detail) of running ``argv`` in ``cwd``; ``expect`` must appear in the error line."""
    before = snapshot(cwd)
    existed = {o for o in outputs if os.path.lexists(cwd / o)}
    code, out, err, exc = run_cli(argv, cwd)
    after = snapshot(cwd)
    detail = f"rc={code} err={err.strip()[:400]!r}"
    if isinstance(exc, Hang):
        return "hang", detail
    changed = [p for p, h in before.items() if after.get(p) != h]
    if changed:
        return "data loss", f"{detail}; changed or removed: {changed}"
    if exc is not None:
        return "traceback", f"{detail}; escaped {type(exc).__name__}: {exc}"
    if "Traceback" in err:
        return "traceback", detail
    if code == 0:
        return "silent", detail
    lines = [line for line in err.splitlines() if line.strip()]
    left = [o for o in outputs if o not in existed and os.path.lexists(cwd / o)]
    temps = [p for p in after if os.path.basename(p).startswith(".tmp-")]
    if code != 2 or len(lines) != 1 or not lines[0].startswith("polykv") or ": error: " not in lines[0]:
        return "wrong", detail
    if expect not in lines[0]:
        return "wrong", f"{detail}; expected {expect!r} in the message"
    if left or temps:
        return "wrong", f"{detail}; left behind {left + temps}"
    return "clear", detail
