"""Built-in quantizers, registered through the same hook a third-party plugin uses.

16-bit streams use :class:`polykv.storage.token_buffer.PassthroughStore`, which is not a
registered quantizer: 16 bits means passthrough for every quantizer.
"""

from polykv.contract import hookimpl
from polykv.adapters.quantizers.kivi import KiviQuantizer

QUANTIZERS: tuple = (KiviQuantizer,)


@hookimpl
def register_quantizers(register):
    for quantizer in QUANTIZERS:
        register(quantizer)
