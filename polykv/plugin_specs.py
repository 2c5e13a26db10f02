"""Plugins named on the command line: ``MODULE:OBJ[,MODULE:OBJ...]`` (``--plugins`` and ``POLYKV_PLUGINS``).

Each spec names an importable module (the current folder is searched too, for this look-up only) and an
attribute of it that carries hook implementations. They are registered into a :class:`~polykv.registry.Registry`
exactly as an installed plugin is, under the name ``MODULE:OBJ``; anything wrong with one is a
:class:`~polykv.errors.RegistryError` naming the spec, and the registry is left as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType
from typing import Any, Iterator

from polykv.contract import hookspecs
from polykv.errors import RegistryError
from polykv.registry import Registry

PLUGINS_ENV = "POLYKV_PLUGINS"
"""Environment variable: plugins to register before a command runs, ``MODULE:OBJ[,MODULE:OBJ...]``."""

_SYNTAX = "give MODULE:OBJ[,MODULE:OBJ...], for example --plugins myplugin:plugin"


def parse_specs(text: str, source: str) -> list[tuple[str, str]]:
    """``(module, attribute)`` pairs of ``text``; ``source`` (``--plugins``, ``POLYKV_PLUGINS``) names it in errors."""
    pairs = []
    for spec in text.split(","):
        spec = spec.strip()
        module, colon, attr = spec.partition(":")
        module, attr = module.strip(), attr.strip()
        if not colon or not module or not attr or ":" in attr:
            raise RegistryError(f"{source}: plugin '{spec}' is not MODULE:OBJ; {_SYNTAX}")
        pairs.append((module, attr))
    return pairs


def _import(module: str, spec: str, source: str) -> ModuleType:
    """Import ``module`` with the current folder on ``sys.path`` for this look-up only."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module written since the last import in this folder
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of a plugin's import is the user's to fix
        raise RegistryError(
            f"{source}: plugin '{spec}': module '{module}' cannot be imported ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())}); check the module name and that it is in the current folder or "
            f"installed") from exc
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _has_hookimpls(registry: Registry, plugin: Any) -> bool:
    for name in dir(plugin):
        try:
            if registry.pm.parse_hookimpl_opts(plugin, name) is not None:
                return True
        except Exception:  # noqa: BLE001 - an attribute that cannot be read is no hook implementation
            continue
    return False


def register_specs(registry: Registry, text: str, source: str) -> list[str]:
    """Register every plugin ``text`` names; returns their names. On an error none of them stays registered."""
    done: list[str] = []
    try:
        for module, attr in parse_specs(text, source):
            spec = f"{module}:{attr}"
            mod = _import(module, spec, source)
            if not hasattr(mod, attr):
                raise RegistryError(f"{source}: plugin '{spec}': module '{module}' ({getattr(mod, '__file__', '')}) "
                                    f"has no attribute '{attr}'; name an object of it that has the hook "
                                    f"implementations")
            plugin = getattr(mod, attr)
            if not _has_hookimpls(registry, plugin):
                raise RegistryError(f"{source}: plugin '{spec}' has no hook implementation (no method marked "
                                    f"@polykv.hookimpl, such as register_operators or register_solvers); "
                                    f"name the object that has them")
            if registry.pm.get_plugin(spec) is not None or registry.pm.is_registered(plugin):
                raise RegistryError(f"{source}: plugin '{spec}' is already registered; name it once")
            try:
                done.append(registry.register_plugin(plugin, name=spec,
                                                     version=str(getattr(mod, "__version__", "0"))))
            except RegistryError as exc:
                raise RegistryError(f"{source}: plugin '{spec}': {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - a misspelled hook, a hook that raises
                raise RegistryError(f"{source}: plugin '{spec}' cannot be registered ({type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())}); fix its hook implementations "
                                    f"(hooks: {', '.join(_hook_names())})") from exc
    except BaseException:
        unregister(registry, done)
        raise
    return done


def unregister(registry: Registry, names: list[str]) -> None:
    """Remove plugins :func:`register_specs` registered (newest first)."""
    for name in reversed(names):
        if registry.pm.get_plugin(name) is not None:
            registry.unregister_plugin(name)


@contextlib.contextmanager
def plugins_registered(registry: Registry, sources: list[tuple[str, str]]) -> Iterator[list[str]]:
    """Register the plugins of each ``(text, source)`` for the ``with`` block; afterwards unregister them and
    forget the modules it imported, so that a later call in this process imports them afresh."""
    before = set(sys.modules)
    names: list[str] = []
    try:
        for text, source in sources:
            names += register_specs(registry, text, source)
        yield names
    finally:
        unregister(registry, names)
        for module in {m for text, _ in sources for m, _ in _lenient_pairs(text)}:
            parts = module.split(".")
            for prefix in (".".join(parts[:i]) for i in range(len(parts), 0, -1)):
                if prefix not in before:
                    sys.modules.pop(prefix, None)


def _lenient_pairs(text: str) -> list[tuple[str, str]]:
    return [tuple(s.strip().partition(":")[::2]) for s in text.split(",")]


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("register_"))
