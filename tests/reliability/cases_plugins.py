"""Bad ``--plugins MODULE:OBJ`` specs on the CLI: each refused in one line naming the spec, before the verb runs.

Every setup writes a throw-away plugin module into the case folder, the folder the CLI runs in (the current
folder is searched for the module)."""

from __future__ import annotations

from cases import add, plan_dict, write

PLUGIN = '''
import polykv
from polykv.contract import ScoredRule


class Newest(ScoredRule):
    """Keeps the newest tokens: score = position, [B, Hkv, T] -> [B, Hkv, T]."""

    name = "{rule}"
    phases = frozenset({{"prefill", "decode"}})
    paper = "none"

    def score(self, ctx):
        return ctx.positions.float()


class Plugin:
    @polykv.hookimpl
    def register_operators(self, register):
        register(Newest)


class Misspelled:
    @polykv.hookimpl
    def register_operator(self, register):
        register(Newest)


class Raising:
    @polykv.hookimpl
    def register_operators(self, register):
        raise RuntimeError("the plugin's own bug")


plugin = Plugin()
misspelled = Misspelled()
raising = Raising()
not_a_plugin = object()
'''


def _module(d, name="throwaway_plug", rule="throwaway-newest", text=None) -> str:
    write(d, f"{name}.py", text if text is not None else PLUGIN.format(rule=rule))
    return name


def _plugins(spec: str, *verb: str):
    """argv of ``polykv --plugins SPEC VERB...`` after writing the module; ``plugins`` when no verb is given."""
    def setup(d):
        _module(d)
        return ["--plugins", spec, *(verb or ("plugins",))]
    return setup


# malformed specs: no colon, an empty part, two colons, an empty item in a list
for _id, _spec in [("no-colon", "throwaway_plug"), ("empty-module", ":plugin"), ("empty-object", "throwaway_plug:"),
                   ("empty", ""), ("blank", "  "), ("two-colons", "throwaway_plug:plugin:x"),
                   ("empty-item", "throwaway_plug:plugin,"), ("only-colon", ":")]:
    add(f"plugins-spec-{_id}", "plugins", _plugins(_spec), "is not MODULE:OBJ")

# the option's value missing
add("plugins-option-without-value", "plugins", lambda d: ["plugins", "--plugins"], "--plugins: expected MODULE:OBJ")
add("plugins-option-then-option", "plugins", lambda d: ["--plugins", "--version"], "--plugins: expected MODULE:OBJ")

# a module that cannot be imported: absent, a syntax error, one that raises at import
add("plugins-module-missing", "plugins", _plugins("no_such_plug:plugin"), "module 'no_such_plug' cannot be imported")
add("plugins-module-syntax-error", "plugins",
    lambda d: ["--plugins", f"{_module(d, 'broken_plug', text='def (:')}:plugin", "plugins"], "module 'broken_plug' cannot be imported (SyntaxError")
add("plugins-module-raises", "plugins",
    lambda d: ["--plugins", _module(d, "raising_plug", text='raise ImportError("needs foo")') + ":plugin",
               "plugins"], "needs foo")

# an attribute that is not there, or not a plugin
add("plugins-object-missing", "plugins", _plugins("throwaway_plug:nope"), "has no attribute 'nope'")
add("plugins-object-not-a-plugin", "plugins", _plugins("throwaway_plug:not_a_plugin"), "no hook implementation")
add("plugins-object-is-a-rule-class", "plugins", _plugins("throwaway_plug:Newest"), "no hook implementation")
add("plugins-misspelled-hook", "plugins", _plugins("throwaway_plug:misspelled"), "register_operator")
add("plugins-hook-raises", "plugins", _plugins("throwaway_plug:raising"), "the plugin's own bug")

# a name clash: with a built-in rule (the registry's error names both plugins), or the same plugin twice
add("plugins-clash-with-builtin", "plugins",
    lambda d: ["--plugins", f"{_module(d, 'clash_plug', rule='h2o')}:plugin", "plugins"], "polykv.adapters.rules")
add("plugins-clash-between-two", "plugins",
    lambda d: ["--plugins", f"{_module(d, 'one_plug')}:plugin,{_module(d, 'two_plug')}:plugin", "plugins"],
    "by plugin 'one_plug:plugin' and by plugin 'two_plug:plugin'")
add("plugins-same-twice", "plugins", _plugins("throwaway_plug:plugin,throwaway_plug:plugin"), "already registered")

# after the verb, and with a verb that would write: nothing is written
add("plugins-after-verb-module-missing", "plugins",
    lambda d: ["plan", "validate", write(d, "p.json", plan_dict()), "--plugins", "no_such_plug:plugin"],
    "polykv plan validate: error: --plugins: plugin 'no_such_plug:plugin'")
add("plugins-solve-writes-nothing", "plugins",
    lambda d: ["--plugins", "no_such_plug:plugin", "solve", "missing.profile.json", "--budget", "0.5", "--context", "64",
               "-o", "out.json"], "polykv solve: error: --plugins: plugin 'no_such_plug:plugin'", outputs=("out.json",))
