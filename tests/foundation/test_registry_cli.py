"""Registry and the ``plugins`` / ``plan`` verbs: third-party names appear, clash loudly, and are checked."""

from __future__ import annotations

import json
import textwrap

import pytest

import polykv
from polykv.cli import main
from polykv.errors import RegistryError
from polykv.contract.rules import ScoredRule
from polykv.registry import DISABLE_ENV, Registry, get_registry, reset_registry
from polykv.testing import tiny_model


class NewestFirstRule(ScoredRule):
    """Keeps the newest tokens: score = position. [B, Hkv, T] -> [B, Hkv, T]."""

    name = "throwaway-newest"
    phases = frozenset({"prefill", "decode"})
    defaults = {"bias": 0.0}

    def score(self, ctx):
        return ctx.positions.float() + self.params["bias"]


class ThrowawayPlugin:
    @polykv.hookimpl
    def register_rules(self, register):
        register(NewestFirstRule)


class ClashingRule(NewestFirstRule):
    name = "h2o"


class ClashingPlugin:
    @polykv.hookimpl
    def register_rules(self, register):
        register(ClashingRule)


@pytest.fixture(scope="module")
def geometry():
    from polykv.models.geometry import geometry_of_model

    return geometry_of_model(tiny_model("llama", layers=3))


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_builtins_are_listed_with_kind_plugin_version_and_phases(capsys):
    rc, out, _ = _run(capsys, "plugins", "--json")
    assert rc == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    h2o = rows[("rule", "h2o")]
    assert h2o["plugin"] == "polykv.adapters.rules" and h2o["version"] == polykv.__version__
    assert set(h2o["phases"]) <= {"prefill", "decode"} and h2o["phases"]
    for (kind, _name), row in rows.items():
        assert ("bits" in row) == (kind == "quantizer"), row
        assert ("phases" in row) == (kind == "rule"), row
    rc, text, _ = _run(capsys, "plugins")
    assert rc == 0 and "h2o" in text and "polykv.adapters.rules" in text


def test_throwaway_plugin_is_listed_and_usable_in_a_plan(capsys, tmp_path, geometry):
    reg = get_registry()
    name = reg.register_plugin(ThrowawayPlugin(), name="throwaway-plugin", version="9.9")
    try:
        rc, out, _ = _run(capsys, "plugins", "--json")
        assert rc == 0
        (row,) = [r for r in json.loads(out) if r["name"] == "throwaway-newest"]
        assert row == {"kind": "rule", "name": "throwaway-newest", "plugin": "throwaway-plugin",
                       "version": "9.9", "phases": ["decode", "prefill"], "signal": "none"}
        plan = polykv.uniform_plan(geometry, prefill="throwaway-newest", decode="throwaway-newest",
                                   capacity=8, params={"bias": 1.5})
        path = tmp_path / "plan.json"
        plan.save(str(path))
        rc, out, err = _run(capsys, "plan", "validate", str(path))
        assert rc == 0, err
        assert "valid plan, 3 layers" in out
    finally:
        reg.unregister_plugin(name)
    rc, _, err = _run(capsys, "plan", "validate", str(path))
    assert rc == 2 and "unknown rule 'throwaway-newest'" in err


def test_duplicate_name_fails_naming_both_plugins():
    reg = get_registry()
    before = reg.names("rule")
    with pytest.raises(RegistryError) as exc:
        reg.register_plugin(ClashingPlugin(), name="clashing-plugin")
    msg = str(exc.value)
    assert "'h2o'" in msg and "polykv.adapters.rules" in msg and "clashing-plugin" in msg
    # The failed registration left nothing behind.
    assert reg.names("rule") == before
    assert reg.pm.get_plugin("clashing-plugin") is None
    assert reg.entry("rule", "h2o").plugin == "polykv.adapters.rules"


def test_unknown_rule_in_plan_lists_available_names(capsys, tmp_path, geometry):
    plan = polykv.uniform_plan(geometry, prefill="no-such-rule", capacity=4)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    rc, out, err = _run(capsys, "plan", "validate", str(path))
    assert rc == 2 and out == ""
    assert "Traceback" not in err
    assert "no-such-rule" in err and "layers[0].prefill.rule" in err
    for available in get_registry().names("rule"):
        assert available in err
    assert "pip install" in err


def _fake_distribution(folder, module: str, dist: str, body: str):
    """A real installed distribution on ``folder``: dist-info metadata + an entry point in group polykv."""
    info = folder / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[polykv]\n{dist} = {module}\n")
    (folder / f"{module}.py").write_text(textwrap.dedent(body))


EP_PLUGIN = '''
import polykv
from polykv.contract.rules import ScoredRule

class EntryPointRule(ScoredRule):
    name = "{rule}"
    def score(self, ctx):
        return ctx.positions.float()

@polykv.hookimpl
def register_rules(register):
    register(EntryPointRule)
'''


def test_env_var_skips_entry_points(tmp_path, monkeypatch, capsys):
    _fake_distribution(tmp_path, "polykv_fake_ep_plugin", "polykv-fake-ep",
                       EP_PLUGIN.format(rule="entry-point-rule"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    loaded = Registry()
    assert loaded.entry("rule", "entry-point-rule").plugin == "polykv-fake-ep"
    assert loaded.entry("rule", "entry-point-rule").version == "0.3"

    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not Registry().has("rule", "entry-point-rule")
    reset_registry()
    try:
        rc, out, _ = _run(capsys, "plugins", "--json")
        assert rc == 0
        names = {r["name"] for r in json.loads(out)}
        assert "entry-point-rule" not in names and "h2o" in names
    finally:
        reset_registry()


def test_clashing_entry_point_makes_cli_exit_2_naming_both(tmp_path, monkeypatch, capsys):
    _fake_distribution(tmp_path, "polykv_fake_clash_plugin", "polykv-fake-clash",
                       EP_PLUGIN.format(rule="tova"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reset_registry()
    try:
        rc, out, err = _run(capsys, "plugins")
        assert rc == 2 and "Traceback" not in err
        assert "'tova'" in err and "polykv.adapters.rules" in err and "polykv-fake-clash" in err
        monkeypatch.setenv(DISABLE_ENV, "1")
        reset_registry()
        rc, _, _ = _run(capsys, "plugins")
        assert rc == 0
    finally:
        reset_registry()
