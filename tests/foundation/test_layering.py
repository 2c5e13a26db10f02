"""The layering of polykv/, enforced: nothing imports upward, and core never names a plugin.

Data flows profile -> solver -> plan -> runtime -> study. Imports follow the same order: a module may
import its own layer and the layers below it, never a layer above. The plan is the hand-over between
solver and runtime; its format (``plan.py``, ``plan_io.py``, ``plan_groups.py``) and its byte model
(``polykv.memory``) are bottom modules every stage reads, like the registry, the errors and the shared
math (``polykv.corpus``, ``polykv.stats``, ``polykv.selection``, ...).

Every module directly in ``polykv/`` is a bottom module unless listed in ``MODULE_LAYER``; every
subpackage must be listed in ``PACKAGE_LAYER`` (a new one fails here until it is given a layer).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from polykv.plan import FULL_RULE
from polykv.registry import get_registry

ROOT = pathlib.Path(__file__).resolve().parents[2] / "polykv"

LAYERS = ("bottom", "profile", "solver", "runtime", "study", "entry")
PACKAGE_LAYER = {
    "polykv.memory": "bottom",        # the plan's byte model: shared math, read by profiling, runtime, studies
    "polykv.profiling": "profile",
    "polykv.solvers": "solver",
    "polykv.runtime": "runtime",
    "polykv.studies": "study",
    "polykv.integrations": "entry",   # lm-eval, Ray: drive studies from outside
    "polykv.commands": "entry",       # the CLI verbs
}
MODULE_LAYER = {
    # the package root re-exports the plan API and polykv.apply (the runtime's entry), so it sits with
    # the runtime; modules below it import from the modules it re-exports, never from it
    "polykv": "runtime",
    "polykv.reference": "runtime",    # runs a plan to compare with the masked reference
    "polykv.families": "runtime",     # checks a model family is served correctly by running plans
    "polykv.testing": "runtime",      # tiny models and decode soaks for tests and studies
    "polykv.cli": "entry",
    "polykv.__main__": "entry",
}
PLUGINS = "polykv.adapters"           # adapters/ (plugins): core never imports them

# (importing module, imported module or package): why it may import upward.
EXCEPTIONS = {
    # One compression path: calibration measures a config by running the runtime's own cache, storage,
    # attention and session code, so a profile's numbers are what the runtime does.
    ("polykv.profiling.capture", "polykv.runtime"): "captures attention with the runtime's sdpa",
    ("polykv.profiling.sensitivity", "polykv.runtime"): "selects and stores through PlanCache/LayerStorage",
    ("polykv.profiling.routing_stats", "polykv.runtime"): "causal masks of the runtime's signals",
    ("polykv.profiling.validation", "polykv.runtime"): "delta-PPL and KL run plans through polykv.runtime.apply",
    # The 16-bit store's token-blocks view is the quantizers' packed layout type (PackedStream, with no
    # codes), imported only when a block reader asks; the type belongs in a bottom module once the
    # quantizer adapters and the runtime can move it together.
    ("polykv.token_buffer", "polykv.adapters.quantizers.packed_stream"): "token_blocks() returns a PackedStream",
    # The package root declares the built-in plugin modules by name (BUILTIN_PLUGINS), so that the
    # registry, a bottom module, names none; the registry imports them when it is built.
    ("polykv", "polykv.adapters"): "declares the built-in rules and quantizers",
    ("polykv", "polykv.studies.builtin_tasks"): "declares the built-in study tasks",
}

# (file relative to polykv/, name): why core may spell a plugin's name there.
NAME_EXCEPTIONS = {
    ("plan.py", "kivi"): "DEFAULT_QUANTIZER: plan files that omit 'quantizer' mean KIVI; existing files must load",
    ("solvers/pyramid.py", "snapkv"): "PyramidKV's published schedule selects with SnapKV (the solver's default)",
    ("commands/demo.py", "snapkv"): "the demo's MoE-nD chain isolates bits and keeps with one named rule",
    ("families.py", "snapkv"): "the family check runs one attention-scoring prefill rule on each family",
    ("families.py", "h2o"): "and one accumulated-attention decode rule",
    ("studies/designs.py", "random"): "a result field of the random-placement control, not the rule",
}


def _module_name(path: pathlib.Path) -> str:
    parts = ("polykv",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def layer_of(module: str) -> str:
    """The layer of a polykv module (``polykv.adapters`` -> ``"plugin"``)."""
    if module == PLUGINS or module.startswith(PLUGINS + "."):
        return "plugin"
    if module in MODULE_LAYER:
        return MODULE_LAYER[module]
    parts = module.split(".")
    if len(parts) >= 2:
        package = ".".join(parts[:2])
        if package in PACKAGE_LAYER:
            return PACKAGE_LAYER[package]
        if (ROOT / parts[1]).is_dir():
            raise AssertionError(f"subpackage {package} has no layer: add it to PACKAGE_LAYER in {__file__}")
    return "bottom"


def _names_a_module(text: str) -> bool:
    """A dotted polykv module path (the bare project name ``"polykv"`` is also the plugin group's name)."""
    return "." in text and (text in MODULES or text == PLUGINS or text.startswith(PLUGINS + "."))


def _imported(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, polykv module) for every import in ``tree``, at module level or inside functions, and for
    every string that spells a polykv module path (``importlib.import_module("polykv.x")``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_module(node.value):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "polykv"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if MODULES.get(module, ROOT).name == "__init__.py" else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "polykv":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES or (ROOT / sub.split(".", 1)[1].replace(".", "/")).is_dir() \
                        or sub.startswith(PLUGINS + "."):
                    out.append((node.lineno, sub))          # ``from polykv import memory``: the submodule
                elif target == "polykv" and alias.name == "__version__":
                    continue                                # the root sets it before importing anything
                else:
                    out.append((node.lineno, target))
    return out


def _exception(module: str, target: str) -> tuple[str, str] | None:
    """The EXCEPTIONS entry that lets ``module`` import ``target``, or None."""
    return next(((m, t) for m, t in EXCEPTIONS if module == m and (target == t or target.startswith(t + "."))), None)


def upward_imports(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, message) for every import of ``module`` that goes to a higher layer or a plugin."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    mine, out = layer_of(module), []
    for line, target in _imported(module, tree):
        theirs = layer_of(target)
        if _exception(module, target):
            continue
        if theirs == "plugin":
            out.append((line, f"core module {module} ({mine}) imports plugin {target}"))
        elif rank[theirs] > rank[mine]:
            out.append((line, f"{module} ({mine}) imports {target} ({theirs})"))
    return out


def test_every_module_has_a_layer_and_nothing_imports_upward():
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {msg}" for module, path in MODULES.items()
             for line, msg in upward_imports(module, ast.parse(path.read_text(), str(path)))]
    assert not found, "upward imports (fix them, or add a justified entry to EXCEPTIONS):\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    used = {_exception(module, target) for module, path in MODULES.items()
            for _, target in _imported(module, ast.parse(path.read_text(), str(path)))} - {None}
    assert used == set(EXCEPTIONS), f"exceptions nothing needs any more: {sorted(set(EXCEPTIONS) - used)}"


def plugin_names() -> set[str]:
    """Names registered by plugins that ship outside core (adapters/): rules, quantizers, allocators.

    Built-in solvers and tasks live in polykv/ and are core; ``full`` is the plan format's own
    keep-everything rule (:data:`polykv.plan.FULL_RULE`), which an adapter merely implements.
    """
    names = {e.name for e in get_registry().entries()
             if getattr(e.obj, "__module__", "").startswith(PLUGINS + ".")}
    return names - {FULL_RULE}


def plugin_name_literals() -> list[tuple[str, int, str]]:
    """(file relative to polykv/, line, name) of every string constant in core, docstrings aside, that
    equals a plugin's name."""
    names, out = plugin_names(), []
    for path in MODULES.values():
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
                      and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
        out += [(path.relative_to(ROOT).as_posix(), n.lineno, n.value) for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                and n.value in names]
    return out


def test_core_never_spells_a_plugin_name():
    assert {"triattention", "h2o", "snapkv", "kivi"} <= plugin_names()   # the check sees the built-in plugins
    found = sorted(f"polykv/{rel}:{line}: {name!r}" for rel, line, name in plugin_name_literals()
                   if (rel, name) not in NAME_EXCEPTIONS)
    assert not found, ("core names a plugin (ask the registry or the rule's declarations instead, or add a "
                       "justified entry to NAME_EXCEPTIONS):\n" + "\n".join(found))


def test_every_name_exception_is_still_needed():
    used = {(rel, name) for rel, _, name in plugin_name_literals()}
    assert set(NAME_EXCEPTIONS) <= used, f"name exceptions nothing needs: {sorted(set(NAME_EXCEPTIONS) - used)}"


@pytest.mark.parametrize("module, source, expected", [
    ("polykv.profiling.x", "from polykv.studies.runner import x",
     "polykv.profiling.x (profile) imports polykv.studies.runner (study)"),
    ("polykv.profiling.x", "def f():\n    import polykv.runtime.cache",
     "polykv.profiling.x (profile) imports polykv.runtime.cache (runtime)"),
    ("polykv.solvers.x", "from polykv import studies", "polykv.solvers.x (solver) imports polykv.studies (study)"),
    ("polykv.registry", "from polykv.solvers import builtin",
     "polykv.registry (bottom) imports polykv.solvers.builtin (solver)"),
    ("polykv.registry", "PLUGINS = ('polykv.studies.builtin_tasks',)",
     "polykv.registry (bottom) imports polykv.studies.builtin_tasks (study)"),
    ("polykv.plan", "import polykv", "polykv.plan (bottom) imports polykv (runtime)"),
    ("polykv.operators", "from polykv.adapters.rules import h2o",
     "core module polykv.operators (bottom) imports plugin polykv.adapters.rules.h2o"),
])
def test_the_check_catches_an_upward_import(module, source, expected):
    """The checker itself reports what it must (and a downward import, below, is fine)."""
    assert [msg for _, msg in upward_imports(module, ast.parse(source))] == [expected]
    assert upward_imports("polykv.studies.x", ast.parse(source)) == [] or "adapters" in source


def private_imports(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, "module.name") for every private name (``_x``) ``module`` imports from another polykv module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("polykv"):
            if node.module == module:
                continue
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    """Modules do not reach into each other's private state: what one module offers another is public."""
    found = [f"{m}:{line} imports {name}" for m, path in _modules().items()
             for line, name in private_imports(m, ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_private_import_check_catches_one():
    tree = ast.parse("from polykv.memory.tokens import _kept, kept_tokens\nfrom polykv.x import y as _y\n")
    assert private_imports("polykv.memory.resident", tree) == [(1, "polykv.memory.tokens._kept")]
