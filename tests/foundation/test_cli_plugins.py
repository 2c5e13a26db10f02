"""``--plugins MODULE:OBJ`` and ``POLYKV_PLUGINS``: a plugin in the current folder, never installed, is registered
for one command (any verb, before or after it) and removed afterwards."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from polykv import load_plan
from polykv.cli import main
from polykv.plugin_specs import PLUGINS_ENV
from polykv.profiling.profile import Profile, moend_configs
from polykv.registry import get_registry

PLUGIN = textwrap.dedent('''
    import polykv
    from polykv.contract import ScoredRule
    from polykv.solvers.uniform import Uniform

    __version__ = "1.2"


    class Newest(ScoredRule):
        """Keeps the newest tokens: score = position, [B, Hkv, T] -> [B, Hkv, T]."""

        name = "cli-plugin-newest"
        phases = frozenset({"prefill", "decode"})
        paper = "none"

        def score(self, ctx):
            return ctx.positions.float()


    class EveryLayerAlike(Uniform):
        """The uniform solver under another name: one config for every layer."""

        name = "cli-plugin-alike"


    class Plugin:
        @polykv.hookimpl
        def register_operators(self, register):
            register(Newest)

        @polykv.hookimpl
        def register_solvers(self, register):
            register(EveryLayerAlike)


    plugin = Plugin()
''')


@pytest.fixture()
def plugin_folder(tmp_path, monkeypatch):
    (tmp_path / "cli_plugin_mod.py").write_text(PLUGIN, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    before = {e.plugin for e in get_registry().entries()}
    yield tmp_path
    after = {e.plugin for e in get_registry().entries()}
    assert after == before and not get_registry().has("solver", "cli-plugin-alike")


def _listed(capsys) -> dict:
    rows = json.loads(capsys.readouterr().out)
    rows = rows if isinstance(rows, list) else rows.get("entries", rows)
    return {r["name"]: r for r in rows}


@pytest.mark.parametrize("argv", [
    ["--plugins", "cli_plugin_mod:plugin", "plugins", "--json"],
    ["plugins", "--json", "--plugins=cli_plugin_mod:plugin"],
])
def test_plugins_option_lists_the_plugin_before_or_after_the_verb(plugin_folder, capsys, argv):
    assert main(argv) == 0
    rows = _listed(capsys)
    assert rows["cli-plugin-newest"]["plugin"] == "cli_plugin_mod:plugin"
    assert rows["cli-plugin-newest"]["version"] == "1.2"
    assert "cli-plugin-alike" in rows


def test_env_var_registers_and_the_option_adds_to_it(plugin_folder, capsys, monkeypatch):
    (plugin_folder / "second_plugin_mod.py").write_text(
        PLUGIN.replace("cli-plugin-", "second-plugin-"), encoding="utf-8")
    monkeypatch.setenv(PLUGINS_ENV, "cli_plugin_mod:plugin")
    assert main(["plugins", "--json"]) == 0
    rows = _listed(capsys)
    assert "cli-plugin-newest" in rows and "second-plugin-newest" not in rows
    assert main(["plugins", "--json", "--plugins", "second_plugin_mod:plugin"]) == 0
    rows = _listed(capsys)
    assert rows["cli-plugin-newest"]["plugin"] == "cli_plugin_mod:plugin"
    assert rows["second-plugin-newest"]["plugin"] == "second_plugin_mod:plugin"


def test_solve_uses_a_solver_the_plugin_registers(plugin_folder, capsys):
    profile = Profile.from_table(np.random.default_rng(0).random((4, 54)), moend_configs("tova"),
                                 {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "num_heads": 4})
    profile.save(str(plugin_folder / "profile.json"))
    out = str(plugin_folder / "plan.json")
    assert main(["solve", "profile.json", "--budget", "4x", "--context", "1024", "--solver", "cli-plugin-alike",
                 "--plugins", "cli_plugin_mod:plugin", "-o", out]) == 0
    capsys.readouterr()
    plan = load_plan(out, registry=get_registry())
    assert plan.provenance.solver == "cli-plugin-alike"
    assert len({repr((layer.prefill, layer.decode)) for layer in plan.layers}) == 1  # one config, every layer


def test_without_the_option_the_solver_is_unknown(plugin_folder, capsys):
    assert main(["solve", "missing.json", "--budget", "4x", "--context", "64", "--solver", "cli-plugin-alike",
                 "-o", "plan.json"]) == 2
    assert not (plugin_folder / "plan.json").exists()


def test_a_module_edited_between_two_commands_is_imported_afresh(plugin_folder, capsys):
    assert main(["--plugins", "cli_plugin_mod:plugin", "plugins", "--json"]) == 0
    assert "cli-plugin-newest" in _listed(capsys)
    (plugin_folder / "cli_plugin_mod.py").write_text(PLUGIN.replace("cli-plugin-newest", "cli-plugin-renamed"),
                                                     encoding="utf-8")
    assert main(["--plugins", "cli_plugin_mod:plugin", "plugins", "--json"]) == 0
    rows = _listed(capsys)
    assert "cli-plugin-renamed" in rows and "cli-plugin-newest" not in rows


def test_a_bad_plugin_is_one_line_and_registers_nothing(plugin_folder, capsys):
    assert main(["--plugins", "cli_plugin_mod:plugin,cli_plugin_mod:nope", "plugins"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polykv plugins: error: --plugins: plugin 'cli_plugin_mod:nope'")


@pytest.mark.parametrize("value,expect", [
    ("cli_plugin_mod", "POLYKV_PLUGINS: plugin 'cli_plugin_mod' is not MODULE:OBJ"),
    ("no_such_cli_mod:plugin", "POLYKV_PLUGINS: plugin 'no_such_cli_mod:plugin': module 'no_such_cli_mod' cannot"),
])
def test_a_bad_env_var_is_one_line_naming_the_variable(plugin_folder, capsys, monkeypatch, value, expect):
    monkeypatch.setenv(PLUGINS_ENV, value)
    assert main(["plugins"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith(f"polykv plugins: error: {expect}")
