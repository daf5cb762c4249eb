"""Gradient codecs: QSGD, 1-bit SGD, sort and k-means quantization, fp16 and none, each a float tensor to a
self-describing 1-D uint8 payload of the same kind and device and back (docs/CODECS.md); picked from
:class:`Compression` or a spec through the registry (``from_spec("qsgd:bits=4,bucket_size=512")``)."""
import numpy as np

import numba_kernels
from numba_kernels import wire
from numba_kernels.wire import HEADER_NBYTES as _HDR
from numba_kernels.wire import PayloadError     # (re-exported, as UnsupportedInputError and noise_key)

from ._arrays import UnsupportedInputError
from ._codec import _check_choice, _check_int, _thread_op, Codec
from ._noise import noise_key

__all__ = ["Codec", "QSGD", "OneBit", "SortQuant", "KMeans", "FP16", "NoCompression", "Compression", "REGISTRY",
           "register", "from_spec", "resolve_codec", "PayloadError", "UnsupportedInputError"]


REGISTRY = {}


def register(name, *aliases):
    """Class decorator: make a codec available to :func:`from_spec` under ``name`` (and ``aliases``),
    matched without regard to case; a name :func:`from_spec` could not read back is refused."""
    for key in (name,) + aliases:
        if not isinstance(key, str) or not key or any(c in key for c in ":,=") or key != "".join(key.split()):
            raise ValueError(f"a codec name is a non-empty str without ':', ',', '=' or white space; got {key!r}")

    def deco(cls):
        cls.name = name
        cls._method = wire.METHODS.get(name, cls._method)      # the header's method code of a codec
        for key in (k.lower() for k in (name,) + aliases):
            if key in REGISTRY:
                raise ValueError(f"codec name {key!r} is already registered to {REGISTRY[key].__name__}")
            REGISTRY[key] = cls
        return cls
    return deco


# spec value parsers: each raises ValueError naming the parameter and the value
def _p_int(key, text):
    try:
        return int(text, 10) if text.lstrip("+-").isdigit() else int(text, 0)     # "08", "0x200"
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer") from None


def _p_opt_int(key, text):
    return None if text.lower() == "none" else _p_int(key, text)


def _p_bool(key, text):
    t = text.lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key}={text!r} is not a boolean (true/false)")


def _p_str(key, text):
    return text.lower()         # the modes and norms: as the codec names, without regard to case


def from_spec(spec):
    """A codec from a spec, ``"name"`` or ``"name:key=value,..."`` (a codec is returned as it is);
    unknown names and keys, malformed items and bad values raise ``ValueError`` naming the part."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a codec spec is a string such as 'qsgd:bits=4'; got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} in spec {spec!r}; known codecs: {', '.join(sorted(REGISTRY))}")
    kwargs = {}
    for item in (rest.split(",") if rest.strip() else []):
        key, eq, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not key:
            raise ValueError(f"bad item {item!r} in codec spec {spec!r}: expected key=value")
        if key not in cls.PARAMS:
            raise ValueError(f"unknown parameter {key!r} for codec {name!r} in spec {spec!r}; "
                             f"known parameters: {', '.join(cls.PARAMS) or 'none'}")
        if key in kwargs:
            raise ValueError(f"parameter {key!r} given twice in codec spec {spec!r}")
        kwargs[key] = text
    try:
        return cls(**{key: cls.PARAMS[key](key, text) for key, text in kwargs.items()})
    except ValueError as e:
        raise ValueError(f"bad value in codec spec {spec!r}: {e}") from None


def _bucket_size(v):
    return None if v is None else _check_int("bucket_size", v, 1, 2 ** 32 - 1)


def _seed(v):
    return None if v is None else _check_int("seed", v, 0, 2 ** 64 - 1)


_MODE_NAMES = {v: k for k, v in wire.MODES.items()}
_NORM_NAMES = {v: k for k, v in wire.NORMS.items()}


@register("qsgd")
class QSGD(Codec):
    """Bucketed QSGD: ``bits``-bit codes and a float32 scale (``norm``) per bucket; ``"stochastic"`` is
    **unbiased**, ``"deterministic"`` **biased**, ``"fake"`` sends float32 (**no savings**) (docs/CODECS.md, "QSGD")."""

    PARAMS = {"bits": _p_int, "bucket_size": _p_int, "mode": _p_str, "norm": _p_str, "seed": _p_opt_int}
    _FIELD_TEXT = {"mode": ("mode", _MODE_NAMES), "param": ("norm", _NORM_NAMES)}

    def __init__(self, bits=4, bucket_size=512, mode="stochastic", norm="max", seed=None):
        mode = _check_choice("mode", mode, tuple(wire.MODES))
        self._freeze(bits=_check_int("bits", bits, 2, 16),
                     bucket_size=_check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1),
                     mode=mode, norm=_check_choice("norm", norm, tuple(wire.NORMS)), seed=_seed(seed),
                     stochastic=mode != "deterministic", _raw_values="float32" if mode == "fake" else None)

    @property
    def levels(self):
        """s = 2**(bits-1) - 1 magnitude levels per sign."""
        return (1 << (self.bits - 1)) - 1

    def __repr__(self):
        r = super().__repr__()
        if self.mode == "fake":
            r += "  # fake: quantize+dequantize locally, payload carries fp32 (same numerics, no savings)"
        return r

    def _fields(self):
        return (self._method, self.bits, wire.MODES[self.mode], wire.NORMS[self.norm], self.bucket_size)

    def _kernel_table(self):
        if self.mode == "fake":         # float32 on the wire: the kernels run on the stochastic twin
            return {}
        c = {"bits": self.bits, "bucket_size": self.bucket_size}
        e = dict(c, stochastic=self.stochastic, norm_l2=self.norm == "l2")
        return {"encode": e, "decode": c, "decode_sum": c, "reduce_requantize": e, "decode_chunks": c}

    @property
    def _twin(self):
        """Fake mode's stochastic twin: the codec whose encode and decode give the values sent."""
        return QSGD(self.bits, self.bucket_size, "stochastic", self.norm, self.seed)

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        if self.mode != "fake":
            return super()._encode_host(arrays, x, pay, words, lay, key, residual)
        twin, n = self._twin, lay.numel
        tmp = np.empty(twin.wire_nbytes(n), np.uint8)
        twin._encode_host(arrays, x, tmp, words, lay, key, residual)
        twin._decode_host(tmp, pay[_HDR:_HDR + 4 * n].view(np.float32), False)
        numba_kernels.cpu.write_header_cpu(pay, words)

    def _encode_dev(self, arrays, x, payload, words, lay, key, residual=None):
        if self.mode != "fake":
            return super()._encode_dev(arrays, x, payload, words, lay, key, residual)
        twin, n, stream = self._twin, lay.numel, arrays.stream(x)     # (accuracy studies, not a hot path)
        xt, _ = arrays.input_f32(x)
        tt, _ = arrays.new_bytes(twin.wire_nbytes(n), x)
        tn, pn = arrays.numba(tt), arrays.numba(payload)
        _thread_op(twin, "encode", True, n)(arrays.numba(xt), tn, words, key, stream,
                                            None if residual is None else arrays.numba(residual))
        _thread_op(twin, "decode", True, n, False)(tn, pn[_HDR:_HDR + 4 * n].view(np.float32), stream)
        numba_kernels.cuda.write_header_cuda(pn, words, stream)


# ---- 1-bit --------------------------------------------------------------------------------------------

_SCALE_NAMES = {v: k for k, v in wire.ONEBIT_SCALES.items()}


@register("onebit", "1bit")
class OneBit(Codec):
    """1-bit SGD: a sign bit per element and float32 scales per bucket (``bucket_size=None``: one), **biased**:
    ``"two_mean"`` preserves the sum, ``"mean_abs"`` is EF-SignSGD's (docs/CODECS.md, "1-bit")."""

    PARAMS = {"bucket_size": _p_opt_int, "scale": _p_str, "error_feedback": _p_bool}
    _FIELD_TEXT = {"mode": ("scale", _SCALE_NAMES), "bucket_size": ("bucket_size", {0: None})}

    def __init__(self, bucket_size=None, scale="two_mean", error_feedback=True):
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise ValueError(f"error_feedback must be True or False; got {error_feedback!r}")
        self._freeze(bucket_size=_bucket_size(bucket_size), error_feedback=bool(error_feedback),
                     scale=_check_choice("scale", scale, tuple(wire.ONEBIT_SCALES)),
                     wants_error_feedback=bool(error_feedback))

    def _fields(self):
        return (self._method, 1, wire.ONEBIT_SCALES[self.scale], 0, self.bucket_size or 0)

    def _kernel_table(self):
        c = {"bucket_size": self.bucket_size or 0, "two_mean": self.scale == "two_mean"}
        return {"encode": c, "decode": c, "decode_sum": c, "reduce_requantize": c, "decode_chunks": c}


# ---- sort quantization ---------------------------------------------------------------------------------

@register("sortquant")
class SortQuant(Codec):
    """Sort quantization: per bucket ``2**split_bits`` groups by rank of value, each uniform in its (min, max);
    ``"stochastic"`` is **unbiased**, ``"deterministic"`` **biased** (docs/CODECS.md, "Sort quantization")."""

    PARAMS = {"bits": _p_int, "split_bits": _p_int, "bucket_size": _p_int, "mode": _p_str,
              "seed": _p_opt_int}
    _FIELD_TEXT = {"mode": ("mode", _MODE_NAMES), "param": ("split_bits", {})}

    def __init__(self, bits=4, split_bits=2, bucket_size=512, mode="stochastic", seed=None):
        bits = _check_int("bits", bits, 2, 16)
        self._freeze(bits=bits, split_bits=_check_int("split_bits", split_bits, 1, bits - 1,
                                                      f" (below bits={bits})"),
                     bucket_size=_check_int("bucket_size", bucket_size, 1, 2 ** 32 - 1),
                     mode=_check_choice("mode", mode, ("stochastic", "deterministic")),
                     seed=_seed(seed), stochastic=mode == "stochastic")

    def _fields(self):
        return (self._method, self.bits, wire.MODES[self.mode], self.split_bits, self.bucket_size)

    _device_pointers = False

    def _kernel_table(self):
        c = {"bits": self.bits, "split_bits": self.split_bits, "bucket_size": self.bucket_size}
        return {"encode": dict(c, stochastic=self.stochastic), "decode": c}


@register("kmeans")
class KMeans(Codec):
    """K-means quantization: per bucket (``bucket_size=None``: one) ``2**bits`` float32 centroids and each
    element's index, **biased** (docs/CODECS.md, "K-means quantization")."""

    PARAMS = {"bits": _p_int, "iters": _p_int, "bucket_size": _p_opt_int, "seed": _p_opt_int}
    stochastic = True           # the sample is drawn with the noise key
    _FIELD_TEXT = {"bucket_size": ("bucket_size", {0: None})}

    def __init__(self, bits=4, iters=20, bucket_size=None, seed=0):
        self._freeze(bits=_check_int("bits", bits, 1, 8), iters=_check_int("iters", iters, 0, 1000),
                     bucket_size=_bucket_size(bucket_size), seed=_seed(seed))

    def _fields(self):
        return (self._method, self.bits, 0, 0, self.bucket_size or 0)

    _device_pointers = False

    def _kernel_table(self):
        c = {"bits": self.bits, "bucket_size": self.bucket_size or 0}
        return {"encode": dict(c, iters=self.iters), "decode": c}


# ---- raw: fp16 and none ---------------------------------------------------------------------------------

class _Raw(Codec):

    def __init__(self):
        self._freeze()

    def _fields(self):
        return (self._method, 16 if self._raw_values == "float16" else 32, 0, 0, 0)

    def _encode_host(self, arrays, x, pay, words, lay, key, residual=None):
        K = numba_kernels.cpu
        xs = arrays.input_np(x)
        K.write_header_cpu(pay, words)
        w = 2 if self._raw_values == "float16" else 4
        vals = pay[_HDR:_HDR + w * xs.size].view(self._raw_values)
        pay[_HDR + w * xs.size:] = 0
        if w == 2 and xs.dtype == np.float32 and vals.ctypes.data % 2 == 0:
            K.half_encode_cpu(xs, vals.view(np.uint16), residual)      # NumPy's rounding, bit for bit
            return
        vals[...] = xs
        if residual is not None:
            np.subtract(xs, vals, out=residual, dtype=np.float32)

    def _encode_dev(self, arrays, x, payload, words, lay, key, residual=None):
        arrays.raw_encode_into(x, self._raw_values, payload)
        numba_kernels.cuda.write_header_cuda(arrays.numba(payload), words, arrays.stream(x))
        if residual is not None:
            arrays.raw_residual(x, payload, self._raw_values, residual)


@register("fp16", "float16")
class FP16(_Raw):
    """Half precision on the wire (Horovod's ``Compression.fp16`` as a payload): 2 bytes per element,
    rounded to nearest (values beyond ±65504 become ±inf), zero padding to a multiple of 4."""
    _raw_values = "float16"


@register("none", "nocompression", "fp32")
class NoCompression(_Raw):
    """No compression: float32 values on the wire (4 bytes per element), exact for float32 input."""
    _raw_values = "float32"


class Compression:
    """Horovod-style namespace: ``Compression.none``, ``Compression.fp16`` (instances), and the
    factories ``Compression.qsgd(...)``, ``.onebit(...)``, ``.sortquant(...)``, ``.kmeans(...)``."""
    none = NoCompression()
    fp16 = FP16()
    qsgd = QSGD              # Compression.qsgd(bits=4) is QSGD(bits=4), and so on
    onebit = OneBit
    sortquant = SortQuant
    kmeans = KMeans


def resolve_codec(compression, horovod_compression=None):
    """A codec from a ``compression=``: a codec, a spec, a :class:`hvd_quant.StockCompression`, None (no
    compression), or ``horovod_compression``'s (a framework's Horovod ``Compression``) ``none``/``fp16``."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, str):
        return from_spec(compression)
    inner = getattr(compression, "codec", None)
    if inner is not None and hasattr(inner, "encode"):
        return inner
    if hasattr(compression, "encode") and hasattr(compression, "wire_nbytes"):
        return compression
    if horovod_compression is not None:
        for hvd_cls, ours in ((horovod_compression.none, NoCompression), (horovod_compression.fp16, FP16)):
            if compression is hvd_cls or isinstance(compression, hvd_cls):
                return ours()
    raise TypeError(f"hvd_quant: compression must be an hvd_quant codec, a spec string or "
                    f"hvd.Compression.none/fp16, got {compression!r}")
