"""The ``polykv`` command line. Each verb lives in its own module under :mod:`polykv.commands`.

A command module defines ``register(subparsers)``, which adds its parser and sets
``func=callable(args) -> int``. Bad input raises :class:`polykv.errors.PolykvError`; the CLI prints
its message (no traceback) and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from polykv import __version__
from polykv.errors import PolykvError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polykv", description="Compose KV-cache compression per layer and phase.")
    parser.add_argument("--version", action="version", version=f"polykv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    import polykv.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"polykv.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PolykvError as exc:
        print(f"polykv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"polykv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
