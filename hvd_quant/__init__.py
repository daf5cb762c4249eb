"""hvd_quant: QSGD and 1-bit SGD gradient compression for Horovod."""
__version__ = "0.1.0"

__all__ = ["QSGD", "OneBit", "FP16", "NoCompression", "Compression", "Codec", "REGISTRY", "register",
           "from_spec", "PayloadError", "UnsupportedInputError", "StockCompression",
           "ConfigMismatchError", "PayloadMismatchError", "__version__"]

# The compressed exchange (issue 4): stock-Horovod adapter and the errors users may catch.
from ._stock import StockCompression  # noqa: E402
from .exchange import ConfigMismatchError, PayloadMismatchError  # noqa: E402

# Codecs (issue 3): QSGD, 1-bit, fp16, none; the registry and the Horovod-style namespace.
from .codecs import (QSGD, OneBit, FP16, NoCompression, Compression, Codec, REGISTRY,  # noqa: E402
                     register, from_spec, PayloadError, UnsupportedInputError)

# TensorFlow: autograph must run the stock-Horovod hooks as plain Python (in a graph they build the
# exchange's ops themselves); it leaves alone functions carrying this attribute. No TensorFlow import.
for _hook in (Codec.compress, Codec.decompress, StockCompression.compress, StockCompression.decompress):
    _hook.autograph_info__ = None
del _hook
