"""The ``polykv`` command line. Each verb lives in its own module under :mod:`polykv.commands`.

A command module defines ``register(subparsers)``, which adds its parser and sets
``func=callable(args) -> int``. A run imports only the module of the verb it runs (:data:`VERBS` names each
verb's module and one-line help, for ``polykv --help``), so a verb module imports what it uses at its top. One error boundary here turns every bad input into one line on
stderr, ``polykv VERB: error: <file or field>: <what to do>``, and exit status 2: polykv's own
errors (:class:`polykv.errors.PolykvError`), argument errors, and the OSError, UnicodeDecodeError,
OverflowError and ValueError that bad input raises deeper down. ``POLYKV_DEBUG=1`` re-raises them
with the traceback. The global option ``--plugins MODULE:OBJ[,...]`` (before or after the verb) and the
environment variable ``POLYKV_PLUGINS`` register plugins for the run (:mod:`polykv.plugin_specs`). A closed stdout (``polykv plugins | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
import warnings

from polykv import __version__
from polykv.contract.model_data import ModelDataNote
from polykv.contract.params import UncheckedParamsWarning
from polykv.errors import PolykvError, PolykvWarning
from polykv.plugin_specs import PLUGINS_ENV, plugins_registered
from polykv.registry import get_registry

DEBUG_ENV = "POLYKV_DEBUG"
"""Environment variable: set to 1 to see the traceback behind an error line."""

EXIT_BAD_INPUT = 2
PLUGINS_OPTION = "--plugins"


class UsageError(Exception):
    """An argument the parser refused; carries the verb and the one-line message."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog, self.message = prog, message


class Parser(argparse.ArgumentParser):
    """argparse, but an argument error is one line (no usage block), raised to the error boundary."""

    def error(self, message: str):
        raise UsageError(self.prog, message)


VERBS = {
    "calibrate": ("calibrate", "measure a per-layer sensitivity profile of a model"),
    "demo": ("demo", "run the MoE-nD chain and a PolyKV route on SmolLM2 (passkey, 8x and 4x) and write a report"),
    "lm-eval": ("lmeval", "run lm-evaluation-harness with the polykv model (--model polykv)"),
    "model-data": ("model_data", "compute per-model data (KVzip head scores, query statistics, key/value bases) into a "
                                 "file"),
    "plan": ("plan", "show or validate a plan file"),
    "plugins": ("plugins", "list registered rules, quantizers, solvers and tasks"),
    "report": ("report", "write a study report (Markdown + figures) from a results file"),
    "solve": ("solve", "make a plan from a profile at a memory budget"),
    "study": ("study", "run plans head-to-head on tasks at matched memory (resumable)"),
}
"""Verb -> (its module in :mod:`polykv.commands`, the one-line help ``polykv --help`` lists). The module's own
``register`` gives the same help (a test holds them equal)."""


def build_parser(verb: str | None = None, *, every_verb: bool = True) -> argparse.ArgumentParser:
    """The parser with every verb's own parser, or (``every_verb=False``) only ``verb``'s, each other verb a
    one-line entry (its module is not imported)."""
    parser = Parser(prog="polykv", description="Compose KV-cache compression per layer and phase.")
    parser.add_argument("--version", action="version", version=f"polykv {__version__}")
    parser.add_argument(PLUGINS_OPTION, action="append", default=[], metavar="MODULE:OBJ[,MODULE:OBJ...]",
                        help=f"register plugins for this run (any verb, before or after it; adds to ${PLUGINS_ENV}): "
                             "an importable module, the current folder included, and its object with the hooks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in VERBS.items():
        if every_verb or name == verb:
            importlib.import_module(f"polykv.commands.{module}").register(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def _verb_of(argv: list[str]) -> str | None:
    """The verb ``argv`` (without its ``--plugins`` options) names: its first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe(exc: BaseException) -> str:
    """The one-line message for an error that reached the boundary."""
    if isinstance(exc, PolykvError):
        return _one_line(exc)
    if isinstance(exc, UnicodeDecodeError):
        return _one_line(f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); give a UTF-8 text file")
    if isinstance(exc, OSError):
        name = exc.filename if exc.filename is not None else ""
        other = f" -> {exc.filename2}" if getattr(exc, "filename2", None) else ""
        what = exc.strerror or str(exc)
        hint = {errno.EACCES: "check its permissions", errno.EPERM: "check its permissions",
                errno.EROFS: "choose a writable location", errno.ENOSPC: "free disk space",
                errno.EISDIR: "give a file, not a folder", errno.ENOTDIR: "check the path",
                errno.ELOOP: "fix the symbolic link", errno.ENOENT: "check the path",
                errno.ENAMETOOLONG: "use a shorter path"}.get(exc.errno, "check the path")
        return _one_line(f"{name}{other}: {what}; {hint}" if name else f"{what}; {hint}")
    if isinstance(exc, OverflowError):
        return _one_line(f"a number is too large ({exc}); give a smaller value")
    return _one_line(f"{exc}; check the arguments and input files")


def _verb(args) -> str:
    parts = [getattr(args, "command", None) or ""]
    for name in ("plan_command",):
        if getattr(args, name, None):
            parts.append(getattr(args, name))
    return " ".join(p for p in parts if p)


@contextlib.contextmanager
def _one_line_warnings(verb: str):
    """polykv's own warnings (unchecked plugin parameters, notes on per-model data, a cache it could not
    write, a device it replaced) as one stderr line each."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (UncheckedParamsWarning, ModelDataNote, PolykvWarning)):
            print(f"polykv {verb}: warning: {_one_line(message)}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _stdout_closed() -> int:
    """stdout's reader went away (``| head``): silence the final flush and exit like a killed pipe writer."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests capture it)
        pass
    return 141


def _take_plugin_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without its ``--plugins X`` / ``--plugins=X`` (anywhere before ``--``), and their values."""
    rest, values = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == PLUGINS_OPTION:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise UsageError("polykv", f"argument {PLUGINS_OPTION}: expected MODULE:OBJ[,MODULE:OBJ...]")
            values.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(PLUGINS_OPTION + "="):
            values.append(arg[len(PLUGINS_OPTION) + 1:])
        else:
            rest.append(arg)
        i += 1
    return rest, values


def _plugin_sources(args) -> list[tuple[str, str]]:
    """(spec text, where it came from): ``POLYKV_PLUGINS`` first, then each ``--plugins``."""
    sources = []
    env = os.environ.get(PLUGINS_ENV, "")
    if env.strip():
        sources.append((env, PLUGINS_ENV))
    sources += [(text, PLUGINS_OPTION) for text in args.plugins]
    return sources


def main(argv: list[str] | None = None) -> int:
    try:
        argv, plugins = _take_plugin_options(list(sys.argv[1:] if argv is None else argv))
        parser = build_parser(_verb_of(argv), every_verb=False)
        args = parser.parse_args(argv)
        args.plugins = [*args.plugins, *plugins]
    except UsageError as exc:
        print(f"{exc.prog}: error: {_one_line(exc.message)} (see {exc.prog} --help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    verb = _verb(args)
    try:
        with _one_line_warnings(verb):
            sources = _plugin_sources(args)
            with (plugins_registered(get_registry(), sources) if sources else contextlib.nullcontext()):
                code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"polykv {verb}: interrupted", file=sys.stderr)
        return 130
    except (PolykvError, OSError, UnicodeDecodeError, OverflowError, ValueError) as exc:
        if _debug():
            raise
        print(f"polykv {verb}: error: {describe(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
