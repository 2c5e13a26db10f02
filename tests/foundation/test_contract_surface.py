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
