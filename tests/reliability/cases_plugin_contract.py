"""A third-party rule class the plugin contract refuses: each is one line when its module is loaded by
``--plugins``, naming the class and what to write instead, before the verb runs.

A rule's class settings (``signal``, ``phases``) and its parameters (typed fields, ``param(...)``, or a default
given by a subclass) are checked when the class is defined, not when a plan first runs it."""

from __future__ import annotations

from cases import add, write

RULE = '''
import polykv
from polykv.contract import ScoredRule, param{extra_import}


class Checked(ScoredRule):
    name = "contract-checked"
{body}

    def score(self, ctx):
        return ctx.positions.float()


class Plugin:
    @polykv.hookimpl
    def register_rules(self, register):
        register(Checked)


plugin = Plugin()
'''

BROKEN = {
    # class settings: a misspelt signal or phase, phases that are not a frozenset
    "signal-misspelt": ('    signal = "observation-window"', "", "signal 'observation-window' is not one of"),
    "signal-constant-name": ('    signal = "SIGNAL_WINDOW"', "", "signal 'SIGNAL_WINDOW' is not one of"),
    "phase-misspelt": ('    phases = frozenset({"prefil"})', "", "phases must be a non-empty frozenset"),
    "phases-empty": ("    phases = frozenset()", "", "phases must be a non-empty frozenset"),
    "phases-a-string": ('    phases = "prefill"', "", "phases must be a non-empty frozenset"),
    # a typed field: its default outside its own declaration, no annotation, an annotation with no checks
    "field-default-below-low": ('    window: int = param(0, low=1, description="observation window")', "",
                                "the default of parameter 'window' must be >= 1, got 0"),
    "field-default-wrong-type": ('    window: int = param("32", low=1)', "",
                                 "the default of parameter 'window' must be an integer >= 1, got '32'"),
    "field-default-not-a-choice": ('    pooling: str = param("mean", choices=("max", "avg"))', "",
                                   "the default of parameter 'pooling' must be one of 'max', 'avg', got 'mean'"),
    "field-default-null": ("    window: int = param(None, low=1)", "",
                           "the default of parameter 'window' must be an integer >= 1, got null"),
    "field-unannotated": ("    window = param(32, low=1)", "", "field 'window' must be a typed param(...)"),
    "field-annotated-tuple": ("    window: tuple = param((1, 2))", "",
                              "parameter 'window' is annotated 'tuple'; annotate it with int, float"),
    "field-annotated-list-of-str": ('    ids: list[str] = param([], min_items=0)', "",
                                    "parameter 'ids' is annotated 'list[str]'"),
    "field-and-param-specs": ('    window: int = param(32, low=1)\n    defaults = {"window": 32}', "",
                              "declare parameters either as fields (param(...)) or in param_specs/defaults, not both"),
}
for _id, (_body, _extra, _expect) in BROKEN.items():
    def _setup(d, body=_body, extra=_extra):
        write(d, "contract_plug.py", RULE.format(body=body, extra_import=extra))
        return ["--plugins", "contract_plug:plugin", "plugins"]
    add(f"plugin-rule-{_id}", "plugins", _setup, _expect)


# a subclass of a built-in rule giving an inherited parameter a default its declaration refuses
SUBCLASS = '''
import polykv
from polykv.adapters.rules.snapkv import SnapKVRule


class Narrow(SnapKVRule):
    name = "contract-narrow"
    {assign}


class Plugin:
    @polykv.hookimpl
    def register_rules(self, register):
        register(Narrow)


plugin = Plugin()
'''
for _id, _assign, _expect in [
        ("subclass-default-below-low", "window = 0", "the default of parameter 'window' must be >= 1, got 0"),
        ("subclass-default-even-kernel", "kernel_size = 4",
         "the default of parameter 'kernel_size' must be an odd integer in [1, 4096], got 4"),
        ("subclass-default-wrong-type", 'pooling = 3', "the default of parameter 'pooling' must be one of"),
]:
    def _setup(d, assign=_assign):
        write(d, "contract_sub.py", SUBCLASS.format(assign=assign))
        return ["--plugins", "contract_sub:plugin", "plugins"]
    add(f"plugin-rule-{_id}", "plugins", _setup, _expect)
