"""Built-in retention rules, registered through the same hook a third-party plugin uses."""

from polykv.adapters.rules.full import FullRule
from polykv.adapters.rules.streamingllm import StreamingLLMRule
from polykv.hookspecs import hookimpl

RULES: tuple = (FullRule, StreamingLLMRule)


@hookimpl
def register_operators(register):
    for rule in RULES:
        register(rule)
