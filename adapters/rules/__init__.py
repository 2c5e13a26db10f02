"""Built-in retention rules, registered through the same hook a third-party plugin uses."""

from polykv.hookspecs import hookimpl

RULES: tuple = ()


@hookimpl
def register_operators(register):
    for rule in RULES:
        register(rule)
