"""Old module paths, kept importable for third-party plugins: each one is the module it moved to.

The plugin contract, the storage building blocks, the attention math, the plan files and the model
helpers once sat side by side in ``polykv/``; they now live in sub-packages that show the
architecture (``docs/concepts.md``). ``import polykv.operators`` (or any old path in
:data:`MOVED`) still works: it warns once with a :class:`DeprecationWarning` that names the new
path, and gives the very module object the new path gives. Nothing inside polykv uses an old path
(``tests/foundation/test_layering.py`` checks it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    # the plugin contract
    "polykv.operators": "polykv.contract.rules",
    "polykv.selection": "polykv.contract.selection",
    "polykv.rule_state": "polykv.contract.state",
    "polykv.params": "polykv.contract.params",
    "polykv.allocators": "polykv.contract.allocators",
    "polykv.model_data": "polykv.contract.model_data",
    "polykv.hookspecs": "polykv.contract.hookspecs",
    "polykv.contract_checks": "polykv.contract.checks",
    # storage building blocks (the last five were in the quantizer plugins' folder)
    "polykv.token_buffer": "polykv.storage.token_buffer",
    "polykv.reserve": "polykv.storage.reserve",
    "polykv.store_checks": "polykv.storage.store_checks",
    "polykv.adapters.quantizers.packed_stream": "polykv.storage.token_blocks",
    "polykv.adapters.quantizers.minmax": "polykv.storage.minmax",
    "polykv.adapters.quantizers.packing": "polykv.storage.packing",
    "polykv.adapters.quantizers.storage": "polykv.storage.store_checks",
    "polykv.adapters.quantizers.passthrough": "polykv.storage.token_buffer",
    # attention math
    "polykv.online_softmax": "polykv.attention.online_softmax",
    "polykv.attention_signals": "polykv.attention.signals",
    "polykv.adapters.quantizers.kivi_triton": "polykv.attention.kivi_triton",
    # plan files (``polykv.plan`` itself is now the package, re-exporting what the module held)
    "polykv.plan_io": "polykv.plan.io",
    "polykv.plan_groups": "polykv.plan.groups",
    # models (``polykv.models`` itself is now the package, re-exporting what the module held)
    "polykv.geometry": "polykv.models.geometry",
    "polykv.families": "polykv.models.families",
    "polykv.reference": "polykv.models.reference",
    "polykv.profiling.query_stats": "polykv.models.query_stats",
    "polykv.corpus": "polykv.models.corpus",
    # shared by calibration and studies, and by a solver and studies
    "polykv.stats": "polykv.profiling.stats",
    "polykv.placements": "polykv.solvers.placements",
    # the runtime's store constructors joined the layer storage they fill (one module, not storage beside stores)
    "polykv.runtime.stores": "polykv.runtime.storage",
    # the one-pass attention and signals joined the rest of the attention math
    "polykv.runtime.signals": "polykv.attention.signals",
}
"""Old dotted module path -> the module it is now."""


class _MovedLoader(importlib.abc.Loader):
    """Loads an old path as the module it moved to (that very module, not a copy)."""

    def __init__(self, new: str):
        self.new = new
        self.real_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.real_spec   # the import system set the old path's spec on it: undo that


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path of :data:`MOVED` and loads it as the module it moved to, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import {new} instead (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
