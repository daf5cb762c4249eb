"""hvd_quant: QSGD, 1-bit SGD, sort and k-means quantization: gradient compression for Horovod."""
__version__ = "0.1.0"

__all__ = ["QSGD", "OneBit", "SortQuant", "KMeans", "FP16", "NoCompression", "Compression", "Codec", "REGISTRY",
           "register", "from_spec", "PayloadError", "UnsupportedInputError", "StockCompression",
           "ConfigMismatchError", "PayloadMismatchError", "__version__"]

from ._stock import StockCompression  # noqa: E402
from .exchange import ConfigMismatchError, PayloadMismatchError  # noqa: E402
from . import two_level  # noqa: E402,F401  (registers reduction="two_level" with the exchange)
from .codecs import (QSGD, OneBit, SortQuant, KMeans, FP16, NoCompression, Compression, Codec,  # noqa: E402
                     REGISTRY, register, from_spec, PayloadError, UnsupportedInputError)

# TensorFlow's autograph must run the codecs and the stock hooks as plain Python (in a graph the hooks
# build the exchange's ops themselves); it leaves alone functions carrying this attribute.
for _cls in {StockCompression} | {c for k in REGISTRY.values() for c in k.__mro__ if c is not object}:
    for _fn in vars(_cls).values():
        _fn = getattr(_fn, "fget", _fn)         # properties: their getter
        if callable(_fn) and hasattr(_fn, "__code__"):
            _fn.autograph_info__ = None
del _cls, _fn
