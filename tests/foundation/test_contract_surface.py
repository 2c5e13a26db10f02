"""The plugin contract stays small: what ``polykv.contract`` exports, and the names of its hooks."""

from __future__ import annotations

import types
import warnings

import pytest

import polykv
from polykv.contract.rules import ScoredRule
from polykv.errors import RegistryError
from polykv.registry import Registry


class _OldStyleRule(ScoredRule):
    name = "old-hook-newest"

    def score(self, ctx):
        return ctx.positions.float()


def test_the_0_1_hook_name_still_registers_a_rule_and_warns():
    registry = Registry(load_entry_points=False)
    plugin = types.SimpleNamespace(register_operators=polykv.hookimpl(lambda register: register(_OldStyleRule)))
    with pytest.warns(DeprecationWarning, match=r"plugin 'old-plugin' implements register_operators, the 0.1 name "
                                                r"of register_rules; rename the hook"):
        registry.register_plugin(plugin, name="old-plugin")
    assert registry.rule("old-hook-newest") is _OldStyleRule
    assert registry.entry("rule", "old-hook-newest").plugin == "old-plugin"
    assert registry.names("operator") == registry.names("rule")      # the 0.1 kind name still looks up rules


def test_the_new_hook_name_registers_without_a_warning():
    registry = Registry(load_entry_points=False)
    plugin = types.SimpleNamespace(register_rules=polykv.hookimpl(lambda register: register(_OldStyleRule)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.register_plugin(plugin, name="new-plugin")
    assert registry.rule("old-hook-newest") is _OldStyleRule
    with pytest.raises(RegistryError, match="unknown rule 'nope'"):
        registry.rule("nope")


# -- the front door ---------------------------------------------------------------------------------

import ast  # noqa: E402
import inspect  # noqa: E402
import pathlib  # noqa: E402

import polykv.contract as contract  # noqa: E402

MAX_NAMES = 25
MAX_TYPES = 10
REPO = pathlib.Path(__file__).resolve().parents[2]
PLUGIN_ROOT = REPO / "adapters"
EXAMPLE = REPO / "examples" / "polykv-value-norm" / "polykv_value_norm" / "__init__.py"
# What has yet to move into its plugin (tests/foundation/test_layering.py: PLUGIN_PENDING).
PENDING: set[tuple[str, str]] = set()   # empty: every plugin imports only the contract


def test_the_front_door_exports_at_most_25_names_and_10_types():
    names = contract.__all__
    types_ = [n for n in names if inspect.isclass(getattr(contract, n))]
    assert len(set(names)) == len(names), "a name is listed twice in polykv.contract.__all__"
    assert len(names) <= MAX_NAMES, f"polykv.contract exports {len(names)} names (at most {MAX_NAMES}): {names}"
    assert len(types_) <= MAX_TYPES, f"polykv.contract exports {len(types_)} types (at most {MAX_TYPES}): {types_}"
    for name in names:
        value = getattr(contract, name)
        if inspect.ismodule(value):     # a building block module: one of the contract's own
            assert value.__name__ == f"polykv.contract.{name}", name


def test_the_front_door_re_exports_nothing_of_memory_models_or_the_registry():
    for name in contract.__all__:
        value = getattr(contract, name)
        if inspect.ismodule(value):
            home = value.__name__
        elif inspect.isclass(value) or inspect.isfunction(value):
            home = value.__module__
        else:
            continue                    # a constant (PHASES) or the hook marker
        # the contract's own modules, or the storage building blocks it offers quantizers (the store base)
        assert home.startswith(("polykv.contract", "polykv.storage")), f"polykv.contract.{name} comes from {home}"


def test_a_name_that_left_the_front_door_still_imports_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"polykv.contract.ParamSpec left the plugin contract's front door "
                                                r"in 0.2; import it from polykv.contract.params"):
        from polykv.contract.params import ParamSpec

        assert contract.ParamSpec is ParamSpec
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        contract.NoSuchName


def _contract_names(tree: ast.AST) -> set[str]:
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "polykv.contract"
            for a in node.names}


def test_the_minimal_example_rule_uses_at_most_3_names():
    names = _contract_names(ast.parse(EXAMPLE.read_text(encoding="utf-8")))
    assert len(names) <= 3, sorted(names)


def _plugin_imports(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute polykv import of a plugin module (module level or not)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "polykv":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "polykv"]
    return out


@pytest.mark.parametrize("path", sorted(PLUGIN_ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(PLUGIN_ROOT)))
def test_a_plugin_imports_only_the_contract_the_errors_and_its_own_package(path):
    rel = str(path.relative_to(PLUGIN_ROOT))
    own = "polykv.adapters." + rel.split("/")[0]
    bad = []
    for line, module, names in _plugin_imports(path):
        if module == "polykv.contract":
            bad += [f"{rel}:{line}: polykv.contract.{n} is not in the front door" for n in names
                    if n not in contract.__all__]
        elif module == "polykv.errors" or module == own or module.startswith(own + "."):
            continue
        elif (rel, module) not in PENDING:
            bad.append(f"{rel}:{line}: imports {module}")
    assert not bad, "\n".join(bad)


def test_every_pending_import_is_still_there():
    found = {(str(p.relative_to(PLUGIN_ROOT)), m) for p in PLUGIN_ROOT.rglob("*.py") for _, m, _ in _plugin_imports(p)}
    assert PENDING <= found, f"moved into the plugin: drop {sorted(PENDING - found)} from PENDING"


def test_the_contract_checkers_moved_from_polykv_testing_with_a_warning():
    import polykv.plugin_checks
    import polykv.testing

    with pytest.warns(DeprecationWarning, match=r"polykv.testing.check_rule moved to polykv.plugin_checks in 0.2"):
        assert polykv.testing.check_rule is polykv.plugin_checks.check_rule
    with pytest.raises(AttributeError, match="no attribute 'check_nothing'"):
        polykv.testing.check_nothing
