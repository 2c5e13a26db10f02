"""The plugin manager: built-in and third-party plugins register through the same hooks.

Built-ins are plugin modules like any other: the ``polykv`` package declares them (its
``BUILTIN_PLUGINS``) with :func:`declare_builtin_plugins` when it is imported, so this bottom module
names no higher layer and no plugin. Third-party plugins are found through the
``polykv`` entry-point group (skipped when the environment variable ``POLYKV_NO_PLUGINS`` is set
to anything but ``""`` or ``"0"``). Each hook receives a ``register`` callable, so the registry
records which plugin provided which name and two plugins claiming one name is an error that
names both.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import warnings
from typing import Any, Iterator

import attrs
import pluggy

from polykv.contract import hookspecs
from polykv.errors import RegistryError

ENTRY_POINT_GROUP = hookspecs.PROJECT
DISABLE_ENV = "POLYKV_NO_PLUGINS"
KINDS = ("rule", "quantizer", "solver", "task", "allocator")
_HOOK_FOR_KIND = {
    "rule": "register_rules",
    "quantizer": "register_quantizers",
    "solver": "register_solvers",
    "task": "register_tasks",
    "allocator": "register_allocators",
}
OLD_KINDS = {"operator": "rule"}
"""Kind names of 0.1 still accepted by the look-ups (``names("operator")`` is ``names("rule")``)."""
OLD_HOOKS = {"register_operators": "register_rules"}
"""Hooks of 0.1 a third-party plugin may still implement; each use warns (DeprecationWarning) once."""
_builtin_plugins: tuple[str, ...] = ()
_builtin_version = "0"


def declare_builtin_plugins(modules: tuple[str, ...], version: str) -> None:
    """Name the modules whose hooks register the built-ins, and their version (the package's).

    Called by the ``polykv`` package on import; every :class:`Registry` built afterwards registers them
    first, under their module names, exactly as it registers an entry-point plugin.
    """
    global _builtin_plugins, _builtin_version
    _builtin_plugins, _builtin_version = tuple(modules), str(version)


def builtin_plugins() -> tuple[str, ...]:
    """The declared built-in plugin modules (see :func:`declare_builtin_plugins`)."""
    return _builtin_plugins


@attrs.define(frozen=True)
class Entry:
    """One registered name: what it is, the class, and which plugin (and version) provided it."""

    kind: str
    name: str
    obj: Any
    plugin: str
    version: str


class Registry:
    """All registered rules, quantizers, solvers, tasks and allocators, by kind and name."""

    def __init__(self, *, load_entry_points: bool | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.add_hookspecs(hookspecs.Deprecated)
        self._versions: dict[str, str] = {}
        self._entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        for modname in _builtin_plugins:
            mod = importlib.import_module(modname)
            self.pm.register(mod, name=modname)
            self._versions[modname] = _builtin_version
        if load_entry_points is None:
            load_entry_points = os.environ.get(DISABLE_ENV, "") in ("", "0")
        if load_entry_points:
            self._load_entry_points()
        self.pm.check_pending()
        self._collect()

    def _load_entry_points(self) -> None:
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                name = ep.name
                if self.pm.get_plugin(name) is not None or self.pm.is_blocked(name):
                    continue
                try:
                    plugin = ep.load()
                except Exception as exc:
                    raise RegistryError(
                        f"plugin '{name}' from distribution '{dist.metadata['name']}' failed to load: {exc!r}. "
                        f"Fix or uninstall it, or set {DISABLE_ENV}=1 to skip third-party plugins."
                    ) from exc
                self.pm.register(plugin, name=name)
                self._versions[name] = dist.version

    def register_plugin(self, plugin: Any, name: str | None = None, version: str = "0") -> str:
        """Register a plugin object (module or class instance) at run time; returns its name.

        If the plugin is broken (a misspelled hook, a name another plugin already registered), the
        error propagates and the registry is left exactly as it was before the call.
        """
        name = self.pm.register(plugin, name=name)
        self._versions[name] = version
        try:
            self.pm.check_pending()
            self._collect()
        except BaseException:
            self.pm.unregister(name=name)
            self._versions.pop(name, None)
            self._collect()
            raise
        return name

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered with :meth:`register_plugin` and everything it provided."""
        self.pm.unregister(name=name)
        self._versions.pop(name, None)
        self._collect()

    def _impls(self, kind: str) -> Iterator[Any]:
        """The implementations of ``kind``'s hook, then those of its old name (each warns: rename the hook)."""
        yield from getattr(self.pm.hook, _HOOK_FOR_KIND[kind]).get_hookimpls()
        for old, new in OLD_HOOKS.items():
            if new == _HOOK_FOR_KIND[kind]:
                for impl in getattr(self.pm.hook, old).get_hookimpls():
                    warnings.warn(f"plugin '{impl.plugin_name}' implements {old}, the 0.1 name of {new}; rename "
                                  f"the hook (the old name goes in 0.3)", DeprecationWarning, stacklevel=2)
                    yield impl

    def _collect(self) -> None:
        entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        for kind in KINDS:
            for impl in self._impls(kind):
                plugin_name = impl.plugin_name

                def register(obj: Any, _kind=kind, _plugin=plugin_name) -> None:
                    name = getattr(obj, "name", None)
                    if not isinstance(name, str) or not name:
                        raise RegistryError(
                            f"plugin '{_plugin}' registered a {_kind} without a string 'name' attribute: {obj!r}"
                        )
                    have = entries[_kind].get(name)
                    if have is not None:
                        raise RegistryError(
                            f"{_kind} name '{name}' is registered twice: by plugin '{have.plugin}' and by "
                            f"plugin '{_plugin}'. Uninstall one of them or rename its {_kind}."
                        )
                    entries[_kind][name] = Entry(_kind, name, obj, _plugin, self._versions.get(_plugin, "0"))

                impl.function(register=register)
        self._entries = entries

    # -- look-ups --------------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[OLD_KINDS.get(kind, kind)])

    def entries(self, kind: str | None = None) -> Iterator[Entry]:
        for k in ([OLD_KINDS.get(kind, kind)] if kind else KINDS):
            yield from (self._entries[k][n] for n in sorted(self._entries[k]))

    def get(self, kind: str, name: str) -> Any:
        """The registered class for ``name``; an unknown name lists what is available (in the caller's word for
        the kind)."""
        try:
            return self._entries[OLD_KINDS.get(kind, kind)][name].obj
        except KeyError:
            raise RegistryError(unknown_name_message(kind, name, self.names(kind))) from None

    def entry(self, kind: str, name: str) -> Entry:
        self.get(kind, name)
        return self._entries[OLD_KINDS.get(kind, kind)][name]

    def has(self, kind: str, name: str) -> bool:
        return name in self._entries[OLD_KINDS.get(kind, kind)]

    def rule(self, name: str):
        return self.get("rule", name)

    def operator(self, name: str):
        """Deprecated: the 0.1 name of :meth:`rule` (and its message says "operator"); use :meth:`rule`."""
        return self.get("operator", name)

    def quantizer(self, name: str):
        return self.get("quantizer", name)

    def solver(self, name: str):
        return self.get("solver", name)

    def task(self, name: str):
        return self.get("task", name)

    def allocator(self, name: str):
        return self.get("allocator", name)


def unknown_name_message(kind: str, name: str, available: list[str]) -> str:
    avail = ", ".join(available) or "(none)"
    return (
        f"unknown {kind} '{name}'. Available: {avail}. A plugin that provides it must be installed "
        f"(pip install the package that declares it in the '{ENTRY_POINT_GROUP}' entry-point group)."
    )


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry (the next :func:`get_registry` rebuilds it)."""
    global _registry
    with _lock:
        _registry = None
