"""Built-in retention rules, registered through the same hook a third-party plugin uses."""

from polykv.adapters.rules.adakv import AdaKVRule
from polykv.adapters.rules.cake import CAKEAllocator, CAKERule
from polykv.adapters.rules.cam import CaMRule
from polykv.adapters.rules.d2o import D2OAllocator, D2ORule
from polykv.adapters.rules.expected_attention import ExpectedAttentionRule
from polykv.adapters.rules.full import FullRule
from polykv.adapters.rules.h2o import H2ORule
from polykv.adapters.rules.key_norm import KeyNormRule
from polykv.adapters.rules.keydiff import KeyDiffRule
from polykv.adapters.rules.kvzap import KVzapAllocator, KVzapRule
from polykv.adapters.rules.kvzip import KVzipAllocator, KVzipRule
from polykv.adapters.rules.kvzip_head import KVzipHeadAllocator, KVzipHeadRule
from polykv.adapters.rules.pyramidkv import PyramidKVAllocator, PyramidKVRule
from polykv.adapters.rules.random_rule import RandomRule
from polykv.adapters.rules.scissorhands import ScissorhandsRule
from polykv.adapters.rules.snapkv import SnapKVRule
from polykv.adapters.rules.streamingllm import StreamingLLMRule
from polykv.adapters.rules.tova import TOVARule
from polykv.adapters.rules.triattention import TriAttentionRule
from polykv.contract import hookimpl

RULES: tuple = (FullRule, StreamingLLMRule, H2ORule, SnapKVRule, TOVARule, TriAttentionRule, RandomRule,
                KeyNormRule, PyramidKVRule, CAKERule, ScissorhandsRule, AdaKVRule, CaMRule, D2ORule,
                ExpectedAttentionRule, KeyDiffRule, KVzipRule, KVzipHeadRule, KVzapRule)
ALLOCATORS: tuple = (PyramidKVAllocator, CAKEAllocator, D2OAllocator, KVzipAllocator, KVzipHeadAllocator,
                      KVzapAllocator)


@hookimpl
def register_rules(register):
    for rule in RULES:
        register(rule)


@hookimpl
def register_allocators(register):
    for allocator in ALLOCATORS:
        register(allocator)
