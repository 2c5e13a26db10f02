"""Old module paths keep working for third-party plugins: same module object, one DeprecationWarning."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import warnings

import pytest

from polykv.moved import MOVED

REPO = pathlib.Path(__file__).resolve().parents[2]


def _import_fresh(name: str, monkeypatch) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``name`` as if for the first time in this process; the module cache is restored after."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent, _, leaf = name.rpartition(".")
    if hasattr(sys.modules.get(parent), leaf):
        monkeypatch.delattr(sys.modules[parent], leaf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns_once(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    module, caught = _import_fresh(old, monkeypatch)
    assert module is new
    assert len(caught) == 1 and f"{old} moved to {MOVED[old]}" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert importlib.import_module(old) is new           # cached now: no second warning
    assert not again
    assert new.__spec__.name == MOVED[old]                    # the module keeps its own identity


def test_the_from_import_forms_work(monkeypatch):
    """``from polykv import operators`` and ``from polykv.operators import X`` as a plugin wrote them."""
    import polykv.contract.rules as rules

    monkeypatch.delitem(sys.modules, "polykv.operators", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from polykv import operators
        from polykv.operators import KVStore, ScoredRule, SelectionContext
    assert operators is rules and ScoredRule is rules.ScoredRule and SelectionContext is rules.SelectionContext
    from polykv.contract import KVStore as front_door
    assert KVStore is front_door


def test_every_old_path_is_gone_and_every_new_one_exists():
    """An old path is only an alias (no file shadows it) and points at a module that exists."""
    for old, new in MOVED.items():
        rel = old.replace("polykv.adapters.", "adapters.").replace(".", "/")
        assert not (REPO / f"{rel}.py").exists() and not (REPO / rel).is_dir(), f"{old} still exists on disk"
        assert importlib.util.find_spec(new) is not None, f"{old} points at {new}, which does not exist"


def test_an_unknown_old_looking_path_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("polykv.operatorz")


@pytest.mark.parametrize("package, module", [("polykv.plan", "polykv.plan.records"),
                                             ("polykv.models", "polykv.models.loading")])
def test_a_module_that_became_a_package_still_offers_every_public_name(package, module):
    """``from polykv.plan import X`` and ``from polykv.models import X`` keep working for every X the
    module offered (a name added to the module later must be re-exported too)."""
    import ast

    pkg, mod = importlib.import_module(package), importlib.import_module(module)
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    public = {n for n in names if not n.startswith("_")}
    assert public - set(pkg.__all__) == set()
    assert all(getattr(pkg, n) is getattr(mod, n) for n in public)
