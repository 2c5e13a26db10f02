"""``polykv.plugin_specs``: a bad ``MODULE:OBJ`` spec is a RegistryError naming it, and leaves the registry as it was."""

from __future__ import annotations

import sys
import textwrap

import pytest

from polykv.errors import RegistryError
from polykv.plugin_specs import parse_specs, plugins_registered, register_specs
from polykv.registry import Registry

PLUGIN = textwrap.dedent('''
    import polykv
    from polykv.contract import ScoredRule


    class Newest(ScoredRule):
        name = "api-plugin-newest"
        phases = frozenset({"prefill", "decode"})
        paper = "none"

        def score(self, ctx):
            return ctx.positions.float()


    class Plugin:
        @polykv.hookimpl
        def register_operators(self, register):
            register(Newest)


    plugin = Plugin()
    inert = object()
''')


@pytest.fixture()
def registry(tmp_path, monkeypatch):
    (tmp_path / "api_plugin_mod.py").write_text(PLUGIN, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    yield Registry(load_entry_points=False)
    sys.modules.pop("api_plugin_mod", None)


@pytest.mark.parametrize("text", ["api_plugin_mod", ":plugin", "api_plugin_mod:", "", "a:b:c", "api_plugin_mod:plugin,"])
def test_malformed_spec_names_the_source_and_the_syntax(text):
    with pytest.raises(RegistryError, match=r"POLYKV_PLUGINS: plugin '.*' is not MODULE:OBJ"):
        parse_specs(text, "POLYKV_PLUGINS")


@pytest.mark.parametrize("text,expect", [
    ("no_such_api_mod:plugin", "module 'no_such_api_mod' cannot be imported"),
    ("api_plugin_mod:missing", "has no attribute 'missing'"),
    ("api_plugin_mod:inert", "has no hook implementation"),
    ("api_plugin_mod:plugin,api_plugin_mod:missing", "'api_plugin_mod:missing'"),
    ("api_plugin_mod:plugin,api_plugin_mod:plugin", "already registered"),
])
def test_bad_spec_registers_nothing(registry, text, expect):
    before = [(e.kind, e.name, e.plugin) for e in registry.entries()]
    with pytest.raises(RegistryError, match=expect):
        register_specs(registry, text, "--plugins")
    assert [(e.kind, e.name, e.plugin) for e in registry.entries()] == before


def test_the_current_folder_is_on_sys_path_for_the_lookup_only(registry, tmp_path):
    with plugins_registered(registry, [("api_plugin_mod:plugin", "--plugins")]) as names:
        assert names == ["api_plugin_mod:plugin"]
        assert registry.entry("rule", "api-plugin-newest").plugin == "api_plugin_mod:plugin"
    assert not registry.has("rule", "api-plugin-newest")
    assert "api_plugin_mod" not in sys.modules
    assert str(tmp_path) not in sys.path
