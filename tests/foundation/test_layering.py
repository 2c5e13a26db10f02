"""The layering of polykv, enforced: nothing imports upward, no import circles, plugins see only the contract.

Data flows profile -> solver -> plan -> runtime -> study, but imports follow who *uses* whom:

    bottom < runtime < profiling < solvers < studies < entry (CLI verbs, integrations)

- **bottom**: the plugin contract (``polykv.contract``), storage building blocks (``polykv.storage``),
  attention math (``polykv.attention``), plan files (``polykv.plan``), the byte model (``polykv.memory``),
  model helpers (``polykv.models``) and the shared modules of the package root (errors, registry, ...);
- **runtime** runs a plan on a model; it imports only the bottom;
- **profiling** measures configs by running the runtime's own code (one compression path);
- **solvers** read a profile and write a plan;
- **studies** run plans head to head, with profiles and solvers;
- **entry**: the CLI and the integrations drive all of them.

A module may import its own layer and the layers below, never a layer above. Every module directly in
``polykv/`` is a bottom module unless listed in ``MODULE_LAYER``; every subpackage must be listed in
``PACKAGE_LAYER`` (a new one fails here until it is given a layer).

Plugins (``adapters/``, installed as ``polykv.adapters``) import only the plugin contract's front door
``polykv.contract`` (its building-block modules as names of it, ``from polykv.contract import storage``),
``polykv.errors`` and their own package (``PLUGIN_PENDING`` lists what has yet to move into them). Core never imports a
plugin, except the package root, which names the built-in plugin modules (``BUILTIN_PLUGINS``).

The bottom packages have an order of their own (``BOTTOM_ORDER``): models, the attention math, storage, the
plugin contract, plans, the byte model. A module of one imports only its own package, the lower ones and the
shared modules of the package root, at module level or inside a function (``BOTTOM_EXCEPTIONS`` would list a
crossing with its reason; there is none).

Import circles: none, counting function-local imports too: a function-local import may defer a heavy
import (a lazy kernel, the CLI's verb modules), never close a circle. Fewer than ``MAX_LOCAL_IMPORTS``
function-local ``polykv`` imports in the tree: a module imports what it uses at its top.
``python tests/foundation/test_layering.py`` prints the counts.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

from polykv.cli import VERBS, build_parser
from polykv.plan import FULL_RULE
from polykv.registry import get_registry

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOT = REPO / "polykv"
PLUGIN_ROOT = REPO / "adapters"

LAYERS = ("bottom", "runtime", "profiling", "solvers", "studies", "entry")
PACKAGE_LAYER = {
    "polykv.contract": "bottom",      # what plugins implement and the runtime calls
    "polykv.storage": "bottom",       # token buffers, codes, the token-blocks view, the reserve policy
    "polykv.attention": "bottom",     # online softmax, attention rows and signals, the fused kernel
    "polykv.plan": "bottom",          # the hand-over between solvers and the runtime
    "polykv.memory": "bottom",        # the plan's byte model
    "polykv.models": "bottom",        # loading models, their geometry, per-model data
    "polykv.runtime": "runtime",
    "polykv.profiling": "profiling",
    "polykv.solvers": "solvers",
    "polykv.studies": "studies",
    "polykv.integrations": "entry",   # lm-eval, Ray: drive studies from outside
    "polykv.commands": "entry",       # the CLI verbs
}
MODULE_LAYER = {
    # the package root re-exports the plan API and polykv.apply (the runtime's entry), so it sits with
    # the runtime; modules below it import from the modules it re-exports, never from it
    "polykv": "runtime",
    "polykv.models.reference": "runtime",   # runs a plan to compare with the masked reference
    "polykv.models.families": "runtime",    # checks a model family is served correctly by running plans
    "polykv.testing": "runtime",            # tiny models, vanilla-equality checks and decode soaks
    "polykv.plugin_checks": "runtime",      # plugin contract checks: they run plugins through polykv.apply
    "polykv.cli": "entry",
    "polykv.__main__": "entry",
}
PLUGINS = "polykv.adapters"
PLUGIN_MAY_IMPORT = ("polykv.contract", "polykv.errors")
"""What a plugin may import besides its own package (``polykv.contract``: the package itself, not its
modules, which it reaches as names of the package: ``from polykv.contract import state``)."""
PLUGIN_PENDING: set[tuple[str, str]] = set()   # empty: every plugin imports only the contract
"""(plugin module, core module) imports that stay until what they import moves into the plugin."""

BOTTOM_ORDER = ("polykv.models", "polykv.attention", "polykv.storage", "polykv.contract", "polykv.plan",
                "polykv.memory")
"""The bottom packages, lowest first: models load and describe models (geometry, per-model data and what a rule
needs measured); the attention math reads a model's attention types; storage holds a layer's tokens (the store
base and its building blocks); the plugin contract declares what plugins implement and offers them the storage
and attention building blocks; a plan names rules, stores and model data; the byte model counts what a plan
holds."""

# (importing module, imported module): why a lower bottom package imports a higher one. None does.
BOTTOM_EXCEPTIONS: dict[tuple[str, str], str] = {}

MAX_LOCAL_IMPORTS = 100
"""Function-local ``from polykv ...`` / ``import polykv...`` lines the tree may hold (polykv/ and adapters/)."""

# Module paths removed in 0.2 (CHANGELOG.md) -> where the module lives now.
REMOVED_PATHS = {
    # the plugin contract
    "polykv.operators": "polykv.contract.rules",
    "polykv.selection": "polykv.contract.selection",
    "polykv.rule_state": "polykv.contract.state",
    "polykv.params": "polykv.contract.params",
    "polykv.allocators": "polykv.contract.allocators",
    "polykv.model_data": "polykv.contract.model_data",
    "polykv.hookspecs": "polykv.contract.hookspecs",
    "polykv.contract_checks": "polykv.runtime.plugin_results",
    "polykv.contract.checks": "polykv.runtime.plugin_results",
    "polykv.memory.schedules": "polykv.contract.schedules",
    # storage building blocks (the last two were in the quantizer plugins' folder)
    "polykv.token_buffer": "polykv.storage.token_buffer",
    "polykv.reserve": "polykv.storage.token_buffer",
    "polykv.store_checks": "polykv.storage.token_buffer",
    "polykv.adapters.quantizers.storage": "polykv.storage.token_buffer",
    # the reserve policy and the store checks joined the buffers they size and check (0.3)
    "polykv.storage.reserve": "polykv.storage.token_buffer",
    "polykv.storage.store_checks": "polykv.storage.token_buffer",
    "polykv.adapters.quantizers.passthrough": "polykv.storage.token_buffer",
    # KIVI's min-max codes, bit packing and fused kernel live in its plugin (they were core modules in 0.2's
    # development; the 0.1 paths in the plugin folder import again)
    "polykv.storage.minmax": "polykv.adapters.quantizers.code_format",
    "polykv.storage.packing": "polykv.adapters.quantizers.code_format",
    # KIVI's code format (min-max groups and their packing) is one module, and what its two stores share is
    # one base (0.3)
    "polykv.adapters.quantizers.minmax": "polykv.adapters.quantizers.code_format",
    "polykv.adapters.quantizers.packing": "polykv.adapters.quantizers.code_format",
    "polykv.adapters.quantizers.code_buffers": "polykv.adapters.quantizers.kivi_store",
    "polykv.attention.kivi_triton": "polykv.adapters.quantizers.kivi_triton",
    # attention math
    "polykv.online_softmax": "polykv.attention.online_softmax",
    "polykv.attention_signals": "polykv.attention.signals",
    # plan files (``polykv.plan`` itself is now the package, re-exporting what the module held)
    "polykv.plan_io": "polykv.plan.io",
    "polykv.plan_groups": "polykv.plan.groups",
    # reading a plan file and checking it are one module (0.3); the side-file checks are polykv.plan.side_files
    "polykv.plan.validation": "polykv.plan.io",
    # models (``polykv.models`` itself is now the package, re-exporting what the module held)
    "polykv.geometry": "polykv.models.geometry",
    "polykv.families": "polykv.models.families",
    "polykv.reference": "polykv.models.reference",
    "polykv.profiling.query_stats": "polykv.adapters.rules.query_stats",
    "polykv.models.query_stats": "polykv.adapters.rules.query_stats",    # TriAttention's data, in its plugin
    "polykv.models.kvzip_heads": "polykv.adapters.rules.kvzip_heads",   # the kvzip-head rule's data, in its plugin
    "polykv.corpus": "polykv.models.corpus",
    # shared by calibration and studies, and by a solver and studies
    "polykv.stats": "polykv.profiling.stats",
    "polykv.placements": "polykv.solvers.placements",
    # the runtime's store constructors joined the layer storage they fill (one module, not storage beside stores)
    "polykv.runtime.stores": "polykv.runtime.storage",
    # the one-pass attention and signals joined the rest of the attention math
    "polykv.runtime.signals": "polykv.attention.signals",
    # the newcomer path through the runtime: one module per responsibility (0.3)
    "polykv.runtime.layer_rules": "polykv.runtime.layer_cache",
    "polykv.runtime.attention": "polykv.runtime.layer_cache",
    "polykv.runtime.support": "polykv.runtime.checks",
    "polykv.runtime.plan_checks": "polykv.runtime.checks",
}
"""Old dotted module path -> the module it is now; none of them imports any more."""

# (importing module, imported module or package): why it may import upward. Only the package root.
EXCEPTIONS = {
    # The package root declares the built-in plugin modules by name (BUILTIN_PLUGINS), so that the
    # registry, a bottom module, names none; the registry imports them when it is built.
    ("polykv", "polykv.adapters"): "declares the built-in rules, quantizers and allocators",
    ("polykv", "polykv.solvers.builtin"): "declares the built-in solvers",
    ("polykv", "polykv.studies.builtin_tasks"): "declares the built-in study tasks",
}

# (file relative to polykv/, name): why core may spell a plugin's name there.
NAME_EXCEPTIONS = {
    ("plan/records.py", "kivi"): "DEFAULT_QUANTIZER: plan files that omit 'quantizer' mean KIVI; existing files must load",
    ("solvers/pyramid.py", "snapkv"): "PyramidKV's published schedule selects with SnapKV (the solver's default)",
    ("commands/demo.py", "snapkv"): "the demo's MoE-nD chain isolates bits and keeps with one named rule",
    ("models/families.py", "snapkv"): "the family check runs one attention-scoring prefill rule on each family",
    ("models/families.py", "h2o"): "and one accumulated-attention decode rule",
    ("studies/designs.py", "random"): "a result field of the random-placement control, not the rule",
}


def _module_name(path: pathlib.Path) -> str:
    base, pkg = (PLUGIN_ROOT, (PLUGINS,)) if path.is_relative_to(PLUGIN_ROOT) else (ROOT, ("polykv",))
    parts = pkg + path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of polykv, the plugins included (``polykv.adapters.*``)."""
    return {_module_name(p): p for base in (ROOT, PLUGIN_ROOT) for p in sorted(base.rglob("*.py"))}


MODULES = _modules()
def _is_plugin(module: str) -> bool:
    return module == PLUGINS or module.startswith(PLUGINS + ".")


CORE = {m: p for m, p in MODULES.items() if not _is_plugin(m)}
PLUGIN_MODULES = {m: p for m, p in MODULES.items() if _is_plugin(m)}


def _tree(path: pathlib.Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def layer_of(module: str) -> str:
    """The layer of a polykv module (``polykv.adapters.*`` -> ``"plugin"``)."""
    if _is_plugin(module):
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


def _target(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES.get(module, ROOT).name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _from_targets(target: str, node: ast.ImportFrom) -> list[str]:
    """``from target import a, b``: the submodule ``target.a`` where ``a`` is one, else ``target``."""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in MODULES or (ROOT / sub.split(".", 1)[1].replace(".", "/")).is_dir():
            out.append(sub)                                 # ``from polykv import memory``: the submodule
        elif target == "polykv" and alias.name == "__version__":
            continue                                        # the root sets it before importing anything
        else:
            out.append(target)
    return out


def _imported(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, polykv module) for every import in ``tree``, at module level or inside functions, and for
    every string that is exactly a polykv module's path (``importlib.import_module("polykv.x")``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and (node.value in MODULES or node.value == PLUGINS):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "polykv"]
        elif isinstance(node, ast.ImportFrom):
            target = _target(module, node)
            if target == "polykv.contract" and _is_plugin(module):
                out.append((node.lineno, target))           # a plugin reaches the contract's modules through it
            elif target.split(".")[0] == "polykv":
                out += [(node.lineno, t) for t in _from_targets(target, node)]
    return out


def _exception(module: str, target: str) -> tuple[str, str] | None:
    """The EXCEPTIONS entry that lets ``module`` import ``target``, or None."""
    return next(((m, t) for m, t in EXCEPTIONS if module == m and (target == t or target.startswith(t + "."))), None)


def _plugin_may_import(module: str, target: str) -> bool:
    return _is_plugin(target) or target == "polykv.contract" or (module, target) in PLUGIN_PENDING or any(
        target == allowed or target.startswith(allowed + ".") for allowed in PLUGIN_MAY_IMPORT[1:])


def upward_imports(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, message) for every import of ``module`` that goes to a higher layer, or (core) to a plugin,
    or (a plugin) to anything but the contract and the shared bottom modules."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    mine, out = layer_of(module), []
    for line, target in _imported(module, tree):
        if mine == "plugin":
            if not _plugin_may_import(module, target):
                out.append((line, f"plugin {module} imports {target}; a plugin imports polykv.contract "
                                  f"(and polykv.errors) only"))
            continue
        if _exception(module, target):
            continue
        theirs = layer_of(target)
        if theirs == "plugin":
            out.append((line, f"core module {module} ({mine}) imports plugin {target}"))
        elif rank[theirs] > rank[mine]:
            out.append((line, f"{module} ({mine}) imports {target} ({theirs})"))
    return out


def test_every_module_has_a_layer_and_nothing_imports_upward():
    found = [f"{path.relative_to(REPO)}:{line}: {msg}" for module, path in MODULES.items()
             for line, msg in upward_imports(module, _tree(path))]
    assert not found, "upward imports (fix them, or add a justified entry to EXCEPTIONS):\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    used = {_exception(module, target) for module, path in CORE.items()
            for _, target in _imported(module, _tree(path))} - {None}
    assert used == set(EXCEPTIONS), f"exceptions nothing needs any more: {sorted(set(EXCEPTIONS) - used)}"


def test_the_layering_sees_every_layer_and_the_plugins():
    """The walk covers adapters/ and every layer has modules (a layer nobody is in is a stale name)."""
    assert {"polykv.adapters.rules.h2o", "polykv.adapters.quantizers.kivi"} <= set(PLUGIN_MODULES)
    assert {layer_of(m) for m in CORE} == set(LAYERS)


def test_the_package_root_shows_the_architecture():
    """At most ten modules sit directly in polykv/; the rest live in sub-packages named for what they are."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 10, root


@pytest.mark.parametrize("module, source, expected", [
    ("polykv.profiling.x", "from polykv.studies.runner import x",
     "polykv.profiling.x (profiling) imports polykv.studies.runner (studies)"),
    ("polykv.runtime.x", "def f():\n    import polykv.profiling.capture",
     "polykv.runtime.x (runtime) imports polykv.profiling.capture (profiling)"),
    ("polykv.runtime.x", "from polykv.solvers import base", "polykv.runtime.x (runtime) imports polykv.solvers.base (solvers)"),
    ("polykv.solvers.x", "from polykv import studies", "polykv.solvers.x (solvers) imports polykv.studies (studies)"),
    ("polykv.registry", "from polykv.solvers import builtin",
     "polykv.registry (bottom) imports polykv.solvers.builtin (solvers)"),
    ("polykv.registry", "PLUGINS = ('polykv.studies.builtin_tasks',)",
     "polykv.registry (bottom) imports polykv.studies.builtin_tasks (studies)"),
    ("polykv.plan.records", "import polykv", "polykv.plan.records (bottom) imports polykv (runtime)"),
    ("polykv.contract.rules", "from polykv.adapters.rules import h2o",
     "core module polykv.contract.rules (bottom) imports plugin polykv.adapters.rules.h2o"),
])
def test_the_check_catches_an_upward_import(module, source, expected):
    """The checker itself reports what it must (and the same import from the entry layer is fine)."""
    assert [msg for _, msg in upward_imports(module, ast.parse(source))] == [expected]
    assert upward_imports("polykv.commands.x", ast.parse(source)) == [] or "adapters" in source


@pytest.mark.parametrize("source, allowed", [
    ("from polykv.contract import ScoredRule", True),
    ("from polykv.contract import storage", True),
    ("from polykv.storage.token_buffer import TokenBuffer", False),
    ("from polykv.errors import PolykvError", True),
    ("from polykv.adapters.rules.snapkv import SnapKVRule", True),
    ("from . import minmax", True),
    ("from polykv.contract.rules import ScoredRule", False),      # the front door, not the rooms behind it
    ("from polykv.solvers.pyramid import pyramid_capacities", False),
    ("def f():\n    from polykv.registry import get_registry", False),
    ("from polykv.runtime.cache import PlanCache", False),
])
def test_the_check_holds_plugins_to_the_contract(source, allowed):
    assert (upward_imports("polykv.adapters.rules.x", ast.parse(source)) == []) is allowed


# -- import circles -------------------------------------------------------------------------------

def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported (inside top-level if/try too), except the
    body of ``if TYPE_CHECKING:``."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def import_graph(module_level_only: bool = True) -> dict[str, set[str]]:
    """module -> the polykv modules it imports (``from a.b import c``: ``a.b.c`` if it is a module,
    else ``a.b``), at module level only or counting function-local imports too. String mentions of a
    module are not imports here."""
    graph = {}
    for module, path in MODULES.items():
        tree = _tree(path)
        nodes = _module_level(tree) if module_level_only else [
            n for n in ast.walk(tree) if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
        if not module_level_only:   # drop what only a TYPE_CHECKING block imports
            skip = {id(s) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                    for b in n.body for s in ast.walk(b)}
            nodes = [n for n in nodes if id(n) not in skip]
        edges = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in MODULES}
            elif isinstance(node, ast.ImportFrom):
                edges |= {t for t in _from_targets(_target(module, node), node) if t in MODULES}
        graph[module] = edges - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circles_at_module_level():
    found = circles(import_graph())
    assert not found, "modules that import each other when imported (move the shared part down a layer):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def _bottom_package(module: str) -> str | None:
    """The bottom package ``module`` is in (``BOTTOM_ORDER``), None for any other module or a runtime-layer one."""
    if layer_of(module) != "bottom":
        return None
    return next((p for p in BOTTOM_ORDER if module == p or module.startswith(p + ".")), None)


def bottom_order_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, target) for every import of a higher bottom package by a lower one, exceptions included."""
    rank = {p: i for i, p in enumerate(BOTTOM_ORDER)}
    out = []
    for module, targets in sorted(graph.items()):
        mine = _bottom_package(module)
        for target in sorted(targets):
            theirs = _bottom_package(target)
            if mine and theirs and rank[theirs] > rank[mine]:
                out.append((module, target))
    return out


def test_the_bottom_packages_keep_their_order():
    """No module of a lower bottom package imports a higher one, at module level or inside a function."""
    found = [f"{m} imports {t}" for m, t in bottom_order_breaks(import_graph(module_level_only=False))
             if (m, t) not in BOTTOM_EXCEPTIONS]
    assert not found, ("a bottom package imports one above it in BOTTOM_ORDER (move the shared part down, or add "
                       "a justified entry to BOTTOM_EXCEPTIONS):\n" + "\n".join(found))


def test_every_bottom_exception_is_still_needed():
    used = set(bottom_order_breaks(import_graph(module_level_only=False)))
    assert set(BOTTOM_EXCEPTIONS) <= used, f"bottom exceptions nothing needs: {sorted(set(BOTTOM_EXCEPTIONS) - used)}"


def test_every_bottom_package_is_ordered():
    assert set(BOTTOM_ORDER) == {p for p, layer in PACKAGE_LAYER.items() if layer == "bottom"}


def test_the_bottom_order_check_catches_one():
    graph = {"polykv.plan.records": {"polykv.memory.tokens"}, "polykv.memory.tokens": {"polykv.plan.records"},
             "polykv.models.families": {"polykv.runtime.cache"}}
    assert bottom_order_breaks(graph) == [("polykv.plan.records", "polykv.memory.tokens")]


def test_no_import_circles_counting_function_local_imports():
    """A function-local import defers a heavy import; it never closes a circle (the shared part moves down)."""
    found = circles(import_graph(module_level_only=False))
    assert not found, "modules that import each other, counting imports inside functions:\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_modules_import_at_their_top():
    """Fewer than MAX_LOCAL_IMPORTS function-local polykv imports in polykv/ and adapters/."""
    found = local_import_lines()
    assert len(found) < MAX_LOCAL_IMPORTS, (f"{len(found)} function-local polykv imports (import at the module's "
                                            f"top unless a real cycle or a heavy optional import forbids it):\n"
                                            + "\n".join(found))


def test_the_circle_check_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# -- old module paths -------------------------------------------------------------------------------

_OLD_PATH = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(REMOVED_PATHS, key=len, reverse=True)) + r")\b(?![\w/])")


def test_nothing_in_the_tree_uses_an_old_module_path():
    """The removed paths (REMOVED_PATHS) are named nowhere in the project's own code, tests, examples,
    benchmarks, scripts and docs (CHANGELOG.md, which lists them, aside)."""
    skip = {pathlib.Path(__file__).resolve()}
    files = [p for folder in ("polykv", "adapters", "tests", "examples", "bench", "scripts", "docs")
             for p in sorted((REPO / folder).rglob("*")) if p.suffix in (".py", ".md", ".sh") and p not in skip]
    found = [f"{p.relative_to(REPO)}:{i}: {m.group(1)} -> {REMOVED_PATHS[m.group(1)]}"
             for p in files + [REPO / "README.md"] for i, line in enumerate(p.read_text().splitlines(), 1)
             for m in _OLD_PATH.finditer(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("old", sorted(REMOVED_PATHS))
def test_a_removed_module_path_no_longer_imports(old):
    """0.x keeps no compatibility layer: an old path is a plain ModuleNotFoundError, and its new home imports."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    importlib.import_module(REMOVED_PATHS[old])


def test_examples_import_only_the_contract():
    """The example plugin shows what a third-party plugin imports: polykv.contract, nothing else."""
    found = []
    for path in sorted((REPO / "examples").rglob("*.py")):
        for line, target in _imported("example", _tree(path)):
            if target != "polykv.contract":
                found.append(f"{path.relative_to(REPO)}:{line}: imports {target}")
    assert not found, "\n".join(found)


# -- plugin names and private names -----------------------------------------------------------------

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
    for path in CORE.values():
        tree = _tree(path)
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
             for line, name in private_imports(m, _tree(path))]
    assert not found, "\n".join(found)


def test_the_private_import_check_catches_one():
    tree = ast.parse("from polykv.memory.tokens import _kept, kept_tokens\nfrom polykv.x import y as _y\n")
    assert private_imports("polykv.memory.resident", tree) == [(1, "polykv.memory.tokens._kept")]


_LOCAL_IMPORT = re.compile(r"^\s+(from polykv|import polykv)")


def local_import_lines() -> list[str]:
    """``file:line`` of every indented ``from polykv ...`` / ``import polykv...`` line in polykv/ and adapters/."""
    return [f"{p.relative_to(REPO)}:{i}" for base in (ROOT, PLUGIN_ROOT) for p in sorted(base.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if _LOCAL_IMPORT.match(line)]


if __name__ == "__main__":   # the counts the layering docs quote
    module_level, every = import_graph(), import_graph(False)
    local = {m: every[m] - edges for m, edges in module_level.items()}
    print(f"modules directly in polykv/: {len(list(ROOT.glob('*.py')))}")
    print(f"circles of module-level imports: {len(circles(module_level))}")
    print(f"function-local imports of polykv modules (module -> module edges): {sum(map(len, local.values()))}")
    print(f"function-local polykv import lines: {len(local_import_lines())} (at most {MAX_LOCAL_IMPORTS - 1})")
    closed = circles(every)
    print(f"circles closed only through function-local imports: {len(closed)}")
    for c in closed:
        print("  " + " <-> ".join(c))
    for m, t in bottom_order_breaks(every):
        print(f"  bottom order: {m} -> {t}" + (" (excepted)" if (m, t) in BOTTOM_EXCEPTIONS else ""))


# -- the CLI imports the verb it runs ------------------------------------------------------------------

def test_every_verb_module_is_in_the_cli_table():
    """cli.VERBS names every module of polykv/commands, and each module registers the help the table lists."""
    modules = {p.stem for p in (ROOT / "commands").glob("*.py") if p.stem != "__init__"}
    assert {module for module, _ in VERBS.values()} == modules
    listed = {a.dest: a.help for action in build_parser()._subparsers._group_actions for a in action._choices_actions}
    assert listed == {verb: help_line for verb, (_, help_line) in VERBS.items()}


_VERB_PROBE = """import contextlib, io, sys
from polykv.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m.startswith("polykv.commands.")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("argv, imported", [
    (["--help"], []),
    (["nosuchverb"], []),
    (["plan", "validate", "no-such-plan.json"], ["polykv.commands.plan"]),
])
def test_the_cli_imports_only_the_verb_it_runs(argv, imported):
    """``polykv --help`` lists the verbs from the table; a run imports its verb's module alone."""
    out = subprocess.run([sys.executable, "-c", _VERB_PROBE, *argv], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1] == repr(imported), out.stderr[-2000:]


# -- test folders -----------------------------------------------------------------------------------

CROSS_CUTTING_TESTS = {"foundation", "reliability", "examples"}
"""Test folders that test across the package (its layering and docs, bad input of every kind, the example
plugin); every other folder of ``tests/`` is named after the package it tests."""


def test_test_folders_mirror_the_package():
    """``tests/<name>/`` tests ``polykv/<name>/`` (``tests/adapters/<name>/``: ``adapters/<name>/``)."""
    tests = REPO / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | {"adapters"}
    assert folders - CROSS_CUTTING_TESTS <= packages, sorted(folders - CROSS_CUTTING_TESTS - packages)
    plugins = {p.name for p in (tests / "adapters").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert plugins <= {p.name for p in PLUGIN_ROOT.iterdir() if (p / "__init__.py").is_file()}, plugins
