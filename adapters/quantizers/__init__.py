"""Built-in quantizers, registered through the same hook a third-party plugin uses."""

from polykv.hookspecs import hookimpl

QUANTIZERS: tuple = ()


@hookimpl
def register_quantizers(register):
    for quantizer in QUANTIZERS:
        register(quantizer)
