"""Errors polykv raises on bad input. Each says what was wrong, where, and what to do next."""

from __future__ import annotations


class PolykvError(Exception):
    """Base class: a user-facing error the CLI prints without a traceback."""


class RegistryError(PolykvError):
    """A plugin problem: duplicate names, unknown names, broken plugins."""


class PlanError(PolykvError):
    """A plan file or plan object is invalid.

    ``source`` is the file (or ``"<plan>"``), ``layer`` the layer index (or None for plan-wide fields),
    ``field`` the dotted field path, ``hint`` what to do about it.
    """

    def __init__(self, message: str, *, source: str | None = None, layer: int | None = None,
                 field: str | None = None, hint: str | None = None):
        self.message, self.source, self.layer, self.field, self.hint = message, source, layer, field, hint
        where = []
        if source:
            where.append(str(source))
        if layer is not None:
            where.append(f"layer {layer}")
        if field:
            where.append(f"field '{field}'")
        text = (": ".join([", ".join(where), message]) if where else message)
        if hint:
            text += f" ({hint})"
        super().__init__(text)


class ProfileError(PolykvError):
    """A profile file or table is invalid or does not match the model."""


class SolverError(PolykvError):
    """A solver cannot produce a plan (for example, the budget is below the cheapest plan)."""


class RuntimeConfigError(PolykvError):
    """The runtime cannot serve this plan on this model (backend, padding, layer type, ...)."""


class StudyError(PolykvError):
    """A study spec, task file or results file is invalid."""


class OutputError(PolykvError):
    """An output path would destroy an input or a file polykv did not write, or cannot be written."""


class PluginContractError(RuntimeConfigError):
    """A plugin (rule, quantizer's store, allocator) returned something its contract forbids.

    The message is one line naming the plugin, the layer, the phase and what was expected vs got.
    """


class PolykvWarning(UserWarning):
    """A one-line note before polykv does something other than asked (the command line prints it as one line)."""


class CacheWriteWarning(PolykvWarning):
    """A cache (converted models, computed per-model data) could not be written: the run goes on with what it
    computed, and the next run computes it again. The message names the folder and why."""


class DeviceFallbackWarning(PolykvWarning):
    """A default device that this machine lacks (lm-eval's ``cuda:0``) is replaced by the CPU."""
