"""Built-in retention rules, registered through the same hook a third-party plugin uses."""

from polykv.adapters.rules.cake import CAKERule
from polykv.adapters.rules.full import FullRule
from polykv.adapters.rules.h2o import H2ORule
from polykv.adapters.rules.key_norm import KeyNormRule
from polykv.adapters.rules.pyramidkv import PyramidKVRule
from polykv.adapters.rules.random_rule import RandomRule
from polykv.adapters.rules.scissorhands import ScissorhandsRule
from polykv.adapters.rules.snapkv import SnapKVRule
from polykv.adapters.rules.streamingllm import StreamingLLMRule
from polykv.adapters.rules.tova import TOVARule
from polykv.adapters.rules.triattention import TriAttentionRule
from polykv.hookspecs import hookimpl

RULES: tuple = (FullRule, StreamingLLMRule, H2ORule, SnapKVRule, TOVARule, TriAttentionRule, RandomRule,
                KeyNormRule, PyramidKVRule, CAKERule, ScissorhandsRule)


@hookimpl
def register_operators(register):
    for rule in RULES:
        register(rule)
