"""hvd_quant: QSGD, 1-bit SGD, sort and k-means quantization: gradient compression for Horovod."""
__version__ = "0.1.0"

__all__ = ["QSGD", "OneBit", "SortQuant", "KMeans", "FP16", "NoCompression", "Compression", "Codec", "REGISTRY",
           "register", "from_spec", "PayloadError", "UnsupportedInputError", "StockCompression",
           "ConfigMismatchError", "PayloadMismatchError", "__version__"]

# The compressed exchange: the stock-Horovod adapter and the errors users may catch.
from ._stock import StockCompression  # noqa: E402
from .exchange import ConfigMismatchError, PayloadMismatchError  # noqa: E402
from . import two_level  # noqa: E402,F401  (registers reduction="two_level" with the exchange)

# Codecs: QSGD, 1-bit, sort and k-means quantization, fp16, none; the registry and the Horovod-style
# namespace.
from .codecs import (QSGD, OneBit, SortQuant, KMeans, FP16, NoCompression, Compression, Codec,  # noqa: E402
                     REGISTRY,
                     register, from_spec, PayloadError, UnsupportedInputError)

# TensorFlow: autograph must run the codecs and the stock-Horovod hooks as plain Python (in a graph
# the hooks build the exchange's ops themselves; a codec is configuration, read while tracing); it
# leaves alone functions carrying this attribute. No TensorFlow import.
for _cls in {StockCompression} | {c for k in REGISTRY.values() for c in k.__mro__ if c is not object}:
    for _fn in vars(_cls).values():
        _fn = getattr(_fn, "fget", _fn)         # properties: their getter
        if callable(_fn) and hasattr(_fn, "__code__"):
            _fn.autograph_info__ = None
del _cls, _fn
