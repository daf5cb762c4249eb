"""Numba CPU kernels (``*_cpu``): ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``.

Each kernel also has a serial twin, used when the input is a single chunk or Numba has one thread (a
parallel region is slow to start). QSGD kernels are compiled per bit width (on its
first use), so every shift and mask is a constant. Launches are prepared once per configuration
(``prepare_*``: layout, chunking and kernel choice computed once; the plain ``*_cpu`` launchers keep
them in a small cache keyed by ints), so a call costs little more than Numba's dispatch.

Work is split into chunks of whole buckets whose first element is a multiple of 8 (so every chunk
writes whole code bytes and no two threads touch one byte); ``prange`` runs over the chunks. Within a
chunk each bucket's scale is computed, then its elements are quantized into a small code array while
they are still in cache; the chunk's codes are then packed: one pass over ``x`` from memory. The 1-bit
kernels split by elements instead (:func:`task_span`): whole buckets as above for buckets of at most
SEGMENT elements; for longer ones (``OneBit()``'s one bucket per tensor) every segment's sums run in
parallel, each bucket's scales follow from them in the canonical order, then the bits are written a
span at a time, so a tensor of one bucket uses every thread.

Every inner loop is written so the compiler vectorises it: loops run over slices with indices from
zero (a negative index would need a wrap-around check per element), the max scale is an integer max
of the bits, the random draws of a group of 64 elements come from one loop of 32 splitmix64 hashes,
codes are packed and unpacked eight at a time through 64-bit words, and the 1-bit encode builds the
bits of 64 elements in one word. Each parallel task's body asks for 512-bit vectors (:func:`_wide`),
which LLVM does not use by default on Intel CPUs with AVX-512.
"""
import functools

import numpy as np
from numba import njit

from . import wire
from ._cpu_base import _STAMP, _hdr_err, _renamed, _write_header, chunk_buckets, task_span
from ._cpu_half import _F16_CHUNK, _half_decode, _half_encode
from ._cpu_kmeans import _kmeans_decode, _kmeans_encode
from ._cpu_onebit import (_onebit_decode, _onebit_decode_chunks, _onebit_decode_sum, _onebit_encode,
                          _onebit_encode_long)
from ._cpu_qsgd import _qsgd_decode, _qsgd_decode_chunks, _qsgd_decode_sum, _qsgd_encode
from ._cpu_sortquant import _sortquant_decode, _sortquant_encode
from ._memo import memo
from ._scalar import SEGMENT

__all__ = ["qsgd_encode_cpu", "qsgd_decode_cpu", "onebit_encode_cpu", "onebit_decode_cpu",
           "half_encode_cpu", "half_decode_cpu",
           "write_header_cpu", "chunk_buckets", "prepare_qsgd_encode", "prepare_qsgd_decode",
           "prepare_onebit_encode", "prepare_onebit_decode", "header_errors_cpu",
           "qsgd_decode_sum_cpu", "onebit_decode_sum_cpu", "qsgd_reduce_requantize_cpu",
           "onebit_reduce_requantize_cpu", "qsgd_decode_chunks_cpu", "onebit_decode_chunks_cpu",
           "prepare_qsgd_decode_sum", "prepare_onebit_decode_sum", "prepare_qsgd_reduce_requantize",
           "prepare_onebit_reduce_requantize", "prepare_qsgd_decode_chunks",
           "prepare_onebit_decode_chunks", "sortquant_encode_cpu", "sortquant_decode_cpu",
           "prepare_sortquant_encode", "prepare_sortquant_decode", "kmeans_encode_cpu", "kmeans_decode_cpu",
           "prepare_kmeans_encode", "prepare_kmeans_decode"]


def half_encode_cpu(x, vals, residual=None):
    """``vals`` (uint16, x.size) = the float16 bits of float32 ``x`` (NumPy's ``astype(float16)``, bit
    for bit); ``residual`` (float32, x.size, may be ``x``), if given, = x - float32(float16(x))."""
    x, vals = _flat(x), _flat(vals)
    if vals.size != x.size or (residual is not None and residual.size != x.size):
        raise ValueError(f"half_encode_cpu: x has {x.size} elements, vals {vals.size}")
    kernel = _half_encode.pick(-(-x.size // _F16_CHUNK))
    if residual is None:
        kernel(x, vals, _NO_RESIDUAL, False, _F16_CHUNK)
    else:
        kernel(x, vals, _flat(residual), True, _F16_CHUNK)


def half_decode_cpu(vals, out, accumulate):
    """``out`` (float32) = (``accumulate``: +=) the float32 values of the float16 bits ``vals``."""
    vals, out = _flat(vals), _flat(out)
    if vals.size != out.size:
        raise ValueError(f"half_decode_cpu: vals has {vals.size} elements, out {out.size}")
    _half_decode.pick(-(-out.size // _F16_CHUNK))(vals, out, bool(accumulate), _F16_CHUNK)


def _write_header_only(payload, header):
    _write_header(payload, header)


def _header_errors(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
    return _hdr_err(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name)


_header_errors = njit(cache=True)(_renamed(_header_errors, "_" + _STAMP))
_write_header_only = njit(cache=True)(_renamed(_write_header_only, "_" + _STAMP))


# ---- launchers (same signatures as numba_kernels.reference) ----------------------------------------

_U64 = np.uint64


_WORD_ARRAYS = {}       # id(header tuple) -> (the tuple, its words as a uint64 array)


def _words(header):
    """The 8 header words as a uint64 array: Numba types an array argument faster than a tuple of
    8 scalars. Tuples, which callers keep (memoised per configuration), are
    converted once; the table holds them, so an id is never reused while it is in there."""
    hit = _WORD_ARRAYS.get(id(header))
    if hit is not None and hit[0] is header:
        return hit[1]
    if type(header) is np.ndarray and header.dtype == np.uint64 and header.shape == (8,) \
            and header.flags.c_contiguous:
        return header
    arr = np.array([int(w) for w in header], dtype=np.uint64)
    if arr.size != 8:
        raise ValueError(f"a header is 8 uint64 words; got {arr.size}")
    if type(header) is tuple:
        if len(_WORD_ARRAYS) >= 4096:
            _WORD_ARRAYS.clear()
        _WORD_ARRAYS[id(header)] = (header, arr)
    return arr


def _flat(a):
    return a if a.ndim == 1 else a.reshape(-1)


def _check_size(payload, total):
    if payload.size != total:
        raise wire.PayloadError(f"payload has {payload.size} bytes, the layout needs {total}")


def header_errors_cpu(payload, expect):
    """Error bits (``wire.ERROR_BITS``) of ``payload``'s header against ``expect`` (a ``wire.Expect``)."""
    m, b, mo, no, bs, n, nh, cn = expect
    return int(_header_errors(payload, m, b, mo, no, bs, n, nh, bool(cn)))


def _check_expect(payload, expect):
    if expect is not None:
        err = header_errors_cpu(payload, expect)
        if err:
            raise wire.PayloadError(wire.describe_error_bits(err))


_NO_RESIDUAL = np.empty(0, np.float32)     # the kernels write a residual only when told to


class _PreparedBase:
    __slots__ = ("numel", "total", "k", "nchunks", "_serial", "_kernel")

    def _setup(self, kernel, lay, bs, span=False):
        """``k``: the kernel's task size, buckets (:func:`chunk_buckets`), or elements with ``span``
        (:func:`task_span`, the 1-bit kernels)."""
        self.numel = lay.numel
        self.total = lay.total
        if span:
            self.k = task_span(bs, lay.numel)
            self.nchunks = -(-lay.numel // self.k)
        else:
            self.k = chunk_buckets(bs, lay.numel)
            self.nchunks = -(-lay.nbuckets // self.k)
        self._kernel = kernel
        self._serial = kernel.serial if self.nchunks <= 1 else None

    # The kernel of a call is ``self._serial or self._kernel.pick(self.nchunks)``, written out at
    # each call site: a method call is a measurable part of a small launch.


class _DecodeCPU(_PreparedBase):
    """A prepared decode: ``(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args",)

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if expect is not None:
            _check_expect(payload, expect)
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payload, out, *self.args, self.k)


class QsgdEncodeCPU(_PreparedBase):
    """``prepare_qsgd_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bits, bucket_size, stochastic, norm_l2):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_encode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, int(bucket_size), bool(stochastic), bool(norm_l2))

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        kernel = self._serial or self._kernel.pick(self.nchunks)
        kernel(x, payload, _words(header), *self.args, _U64(key), self.k, res, has)


class QsgdDecodeCPU(_DecodeCPU):
    """``prepare_qsgd_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_decode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bucket_size), bool(accumulate))


class OnebitEncodeCPU(_PreparedBase):
    """``prepare_onebit_encode(...)(x, payload, header, key=0, stream=None, residual=None)``: the
    signature of every prepared encode (``key`` unused: 1-bit draws no noise)."""
    __slots__ = ("args",)

    def __init__(self, numel, bucket_size, two_mean):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_encode if bs <= SEGMENT else _onebit_encode_long, lay, bs, span=True)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, bs, bool(two_mean))

    def __call__(self, x, payload, header, key=0, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        if payload.size != self.total:
            _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        kernel = self._serial or self._kernel.pick(self.nchunks)
        kernel(x, payload, _words(header), *self.args, self.k, res, has)


class OnebitDecodeCPU(_DecodeCPU):
    """``prepare_onebit_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bucket_size, two_mean, accumulate):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_decode, lay, bs, span=True)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean),
                     bool(accumulate))


class SortquantEncodeCPU(QsgdEncodeCPU):
    """``prepare_sortquant_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, split_bits, bucket_size, stochastic):
        lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
        self._setup(_sortquant_encode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, int(bucket_size), int(split_bits), bool(stochastic))


class SortquantDecodeCPU(QsgdDecodeCPU):
    """``prepare_sortquant_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, split_bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
        self._setup(_sortquant_decode[bits], lay, bucket_size)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bucket_size), int(split_bits),
                     bool(accumulate))


def prepare_sortquant_encode(numel, bits, split_bits, bucket_size, stochastic):
    return SortquantEncodeCPU(int(numel), int(bits), int(split_bits), int(bucket_size), bool(stochastic))


def prepare_sortquant_decode(numel, bits, split_bits, bucket_size, accumulate):
    return SortquantDecodeCPU(int(numel), int(bits), int(split_bits), int(bucket_size), bool(accumulate))


class KmeansEncodeCPU(QsgdEncodeCPU):
    """``prepare_kmeans_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, iters):
        lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
        bs = bucket_size or max(numel, 1)
        self._setup(_kmeans_encode[bits], lay, bs)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, bs, int(iters))


class KmeansDecodeCPU(QsgdDecodeCPU):
    """``prepare_kmeans_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
        bs = bucket_size or max(numel, 1)
        self._setup(_kmeans_decode[bits], lay, bs, span=True)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(accumulate))


def prepare_kmeans_encode(numel, bits, bucket_size, iters):
    """``bucket_size`` 0: one bucket per tensor."""
    return KmeansEncodeCPU(int(numel), int(bits), int(bucket_size or 0), int(iters))


def prepare_kmeans_decode(numel, bits, bucket_size, accumulate):
    return KmeansDecodeCPU(int(numel), int(bits), int(bucket_size or 0), bool(accumulate))


def prepare_qsgd_encode(numel, bits, bucket_size, stochastic, norm_l2):
    return QsgdEncodeCPU(int(numel), int(bits), int(bucket_size), bool(stochastic), bool(norm_l2))


def prepare_qsgd_decode(numel, bits, bucket_size, accumulate):
    return QsgdDecodeCPU(int(numel), int(bits), int(bucket_size), bool(accumulate))


def prepare_onebit_encode(numel, bucket_size, two_mean):
    return OnebitEncodeCPU(int(numel), int(bucket_size or 0), bool(two_mean))


def prepare_onebit_decode(numel, bucket_size, two_mean, accumulate):
    return OnebitDecodeCPU(int(numel), int(bucket_size or 0), bool(two_mean), bool(accumulate))


_cached = functools.partial(memo, {})     # (key, make, *args) -> the prepared launch


def write_header_cpu(payload, header, stream=None):
    _write_header_only(payload, _words(header))


def qsgd_encode_cpu(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=None,
                    residual=None):
    """Bucketed QSGD encode of float32 ``x`` into ``payload`` (see ``qsgd_encode_ref``)."""
    n = x.size
    _cached((0, n, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_encode, n, bits, bucket_size,
            stochastic, norm_l2)(x, payload, header, key, stream, residual)


def qsgd_decode_cpu(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= dequantized QSGD payload (see ``qsgd_decode_ref``)."""
    n = out.size
    _cached((1, n, bits, bucket_size, accumulate), prepare_qsgd_decode, n, bits, bucket_size,
            accumulate)(payload, out, stream, status, expect)


def sortquant_encode_cpu(x, payload, header, bits, split_bits, bucket_size, stochastic, key, stream=None,
                         residual=None):
    """Sort quantization of float32 ``x`` into ``payload`` (see ``sortquant_encode_ref``)."""
    n = x.size
    _cached((10, n, bits, split_bits, bucket_size, stochastic), prepare_sortquant_encode, n, bits,
            split_bits, bucket_size, stochastic)(x, payload, header, key, stream, residual)


def sortquant_decode_cpu(payload, out, bits, split_bits, bucket_size, accumulate, stream=None, status=None,
                         expect=None):
    """out (+)= decoded sort-quantized payload (see ``sortquant_decode_ref``)."""
    n = out.size
    _cached((11, n, bits, split_bits, bucket_size, accumulate), prepare_sortquant_decode, n, bits,
            split_bits, bucket_size, accumulate)(payload, out, stream, status, expect)


def kmeans_encode_cpu(x, payload, header, bits, bucket_size, iters, key, stream=None, residual=None):
    """KMeans encode of float32 ``x`` into ``payload`` (see ``kmeans_encode_ref``)."""
    n = x.size
    _cached((12, n, bits, bucket_size, iters), prepare_kmeans_encode, n, bits, bucket_size, iters)(
        x, payload, header, key, stream, residual)


def kmeans_decode_cpu(payload, out, bits, bucket_size, accumulate, stream=None, status=None, expect=None):
    """out (+)= decoded KMeans payload (see ``kmeans_decode_ref``)."""
    n = out.size
    _cached((13, n, bits, bucket_size, accumulate), prepare_kmeans_decode, n, bits, bucket_size,
            accumulate)(payload, out, stream, status, expect)


def onebit_encode_cpu(x, payload, header, bucket_size, two_mean, stream=None, residual=None):
    """1-bit encode (see ``onebit_encode_ref``); ``bucket_size`` 0 = one bucket per tensor."""
    n = x.size
    _cached((2, n, bucket_size, two_mean), prepare_onebit_encode, n, bucket_size, two_mean)(
        x, payload, header, 0, stream, residual)


def onebit_decode_cpu(payload, out, bucket_size, two_mean, accumulate, stream=None, status=None,
                      expect=None):
    n = out.size
    _cached((3, n, bucket_size, two_mean, accumulate), prepare_onebit_decode, n, bucket_size, two_mean,
            accumulate)(payload, out, stream, status, expect)


# ---- fused operations (see numba_kernels.reference): several payloads per call ------------------------

def _method_layout(numel, bits, bucket_size, two_mean):
    """(layout, bucket size used by the kernels) of QSGD (``two_mean`` None) or 1-bit payloads."""
    if two_mean is None:
        return wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size), bucket_size
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    return (wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode),
            int(bucket_size) or max(numel, 1))


def _check_all(payloads, n, total, expect):
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    if payloads.size != n * total:
        raise wire.PayloadError(f"payloads has {payloads.size} bytes, {n} payloads of {total} need "
                                f"{n * total}")
    if expect is not None:
        for k in range(n):
            _check_expect(payloads[k * total:(k + 1) * total], expect)


class _DecodeSumCPU(_PreparedBase):
    """``prepare_*_decode_sum(...)(payloads, n, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args", "qsgd")

    def __init__(self, numel, bits, bucket_size, two_mean):
        lay, bs = _method_layout(numel, bits, bucket_size, two_mean)
        self.qsgd = two_mean is None
        self._setup(_qsgd_decode_sum[bits] if self.qsgd else _onebit_decode_sum, lay, bs, not self.qsgd)
        if self.qsgd:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs)
        else:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean))

    def _run(self, payloads, n, out, addend):
        if self.numel:
            has = addend is not None
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payloads, n, self.total, out, *self.args, self.k, addend if has else out, has)

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        _check_all(payloads, n, self.total, expect)
        self._run(payloads, n, out, None)


class _ReduceRequantizeCPU:
    """``prepare_qsgd_reduce_requantize(...)(payloads, n, residual, out_payload, header, key,
    stream=None, status=None, expect=None)`` (1-bit: ``key`` is ignored). The sum (plus the residual)
    goes to a scratch array, then the encode kernel quantizes it and writes the new residual."""
    __slots__ = ("numel", "sum", "encode")

    def __init__(self, numel, bits, bucket_size, two_mean, stochastic=False, norm_l2=False):
        self.numel = numel
        self.sum = _DecodeSumCPU(numel, bits, bucket_size, two_mean)
        self.encode = (QsgdEncodeCPU(numel, bits, bucket_size, stochastic, norm_l2) if two_mean is None
                       else OnebitEncodeCPU(numel, bucket_size, two_mean))

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        _check_all(payloads, n, self.sum.total, expect)
        _check_size(out_payload, self.sum.total)
        if residual is not None:
            residual = _flat(residual)
            if residual.size != self.numel:
                raise ValueError(f"residual has {residual.size} elements, this launch was prepared "
                                 f"for {self.numel}")
        c = np.empty(self.numel, np.float32)
        self.sum._run(payloads, n, c, residual)
        self.encode(c, out_payload, header, key, stream, residual)


class _DecodeChunksCPU:
    """``prepare_*_decode_chunks(...)(gathered, out, stream=None, status=None, name_hashes=None,
    expect=None)``: chunk j's payload decoded into ``out[j*chunk:(j+1)*chunk]``."""
    __slots__ = ("numel", "total", "offsets", "method", "bits", "mode", "bs0", "chunk", "args",
                 "_kernel", "_serial", "ntasks", "kchunk", "_exps")

    def __init__(self, numel, bits, bucket_size, chunk, two_mean):
        from .reference import chunk_ranges
        ranges = chunk_ranges(numel, bucket_size, chunk)
        self.numel, self.bits, self.bs0, self.chunk = numel, bits, bucket_size, chunk
        self._exps = None
        qsgd = two_mean is None
        self.method = wire.METHODS["qsgd" if qsgd else "onebit"]
        self.mode = 0 if qsgd else wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        full, bs = _method_layout(min(chunk, numel), bits, bucket_size, two_mean)
        last, _ = _method_layout(ranges[-1][1] - ranges[-1][0] if ranges else 0, bits, bucket_size,
                                 two_mean)
        self.offsets = [j * full.total for j in range(len(ranges))] + [
            (len(ranges) - 1) * full.total + last.total if ranges else 0]
        self.total = self.offsets[-1]
        if not bucket_size:
            chunk = bs                                   # one chunk of one bucket
        if qsgd:            # a task: kchunk buckets of one chunk; 1-bit: kchunk elements (task_span)
            self.kchunk = chunk_buckets(bs, numel)
            self.ntasks = len(ranges) * -(-(chunk // bs) // self.kchunk)
        else:
            self.kchunk = task_span(bs, numel)
            self.ntasks = len(ranges) * -(-chunk // self.kchunk)
        common = (chunk, full.total, full.scales_offset, full.nscales, last.total, last.scales_offset,
                  last.nscales, full.codes_offset)
        self.args = common + ((bs,) if qsgd else (bs, bool(two_mean)))
        self._kernel = _qsgd_decode_chunks[bits] if qsgd else _onebit_decode_chunks
        self._serial = self._kernel.serial if self.ntasks <= 1 else None

    def __call__(self, gathered, out, stream=None, status=None, name_hashes=None, expect=None):
        from .reference import chunk_expects
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        if gathered.size != self.total:
            raise wire.PayloadError(f"gathered has {gathered.size} bytes, the chunks need {self.total}")
        if expect is not None or name_hashes is not None:
            key = (expect, id(name_hashes))         # a caller passes the same ones every step
            exps = self._exps                       # (read once: another thread may replace it)
            if exps is None or exps[0] != key:
                exps = self._exps = (key, name_hashes, chunk_expects(self.numel, self.bs0, self.chunk,
                                                                     self.method, self.bits, self.mode,
                                                                     expect, name_hashes))
            for j, e in enumerate(exps[2]):
                _check_expect(gathered[self.offsets[j]:self.offsets[j + 1]], e)
        if self.numel:
            k = self._serial if self._serial is not None else self._kernel.pick(self.ntasks)
            k(gathered, out, *self.args, self.kchunk)


def prepare_qsgd_decode_sum(numel, bits, bucket_size):
    return _DecodeSumCPU(int(numel), int(bits), int(bucket_size), None)


def prepare_onebit_decode_sum(numel, bucket_size, two_mean):
    return _DecodeSumCPU(int(numel), 1, int(bucket_size or 0), bool(two_mean))


def prepare_qsgd_reduce_requantize(numel, bits, bucket_size, stochastic, norm_l2):
    return _ReduceRequantizeCPU(int(numel), int(bits), int(bucket_size), None, bool(stochastic),
                                bool(norm_l2))


def prepare_onebit_reduce_requantize(numel, bucket_size, two_mean):
    return _ReduceRequantizeCPU(int(numel), 1, int(bucket_size or 0), bool(two_mean))


def prepare_qsgd_decode_chunks(numel, bits, bucket_size, chunk):
    return _DecodeChunksCPU(int(numel), int(bits), int(bucket_size), int(chunk), None)


def prepare_onebit_decode_chunks(numel, bucket_size, two_mean, chunk):
    return _DecodeChunksCPU(int(numel), 1, int(bucket_size or 0), int(chunk), bool(two_mean))


def qsgd_decode_sum_cpu(payloads, n, out, bits, bucket_size, stream=None, status=None, expect=None):
    """out = the float32 sum of ``n`` QSGD payloads' decodes (see ``qsgd_decode_sum_ref``)."""
    m = out.size
    _cached((4, m, bits, bucket_size), prepare_qsgd_decode_sum, m, bits, bucket_size)(
        payloads, n, out, stream, status, expect)


def onebit_decode_sum_cpu(payloads, n, out, bucket_size, two_mean, stream=None, status=None,
                          expect=None):
    m = out.size
    _cached((5, m, bucket_size, two_mean), prepare_onebit_decode_sum, m, bucket_size, two_mean)(
        payloads, n, out, stream, status, expect)


def qsgd_reduce_requantize_cpu(payloads, n, residual, out_payload, header, bits, bucket_size, stochastic,
                               norm_l2, key, stream=None, status=None, expect=None):
    """SRA's phase 2 (see ``qsgd_reduce_requantize_ref``); numel is the header's."""
    m = int(header[2])
    _cached((6, m, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_reduce_requantize, m, bits,
            bucket_size, stochastic, norm_l2)(payloads, n, residual, out_payload, header, key, stream,
                                              status, expect)


def onebit_reduce_requantize_cpu(payloads, n, residual, out_payload, header, bucket_size, two_mean,
                                 stream=None, status=None, expect=None):
    m = int(header[2])
    _cached((7, m, bucket_size, two_mean), prepare_onebit_reduce_requantize, m, bucket_size, two_mean)(
        payloads, n, residual, out_payload, header, 0, stream, status, expect)


def qsgd_decode_chunks_cpu(gathered, out, bits, bucket_size, chunk, stream=None, status=None,
                           name_hashes=None, expect=None):
    """SRA's phase 3 (see ``qsgd_decode_chunks_ref``)."""
    m = out.size
    _cached((8, m, bits, bucket_size, chunk), prepare_qsgd_decode_chunks, m, bits, bucket_size, chunk)(
        gathered, out, stream, status, name_hashes, expect)


def onebit_decode_chunks_cpu(gathered, out, bucket_size, two_mean, chunk, stream=None, status=None,
                             name_hashes=None, expect=None):
    m = out.size
    _cached((9, m, bucket_size, two_mean, chunk), prepare_onebit_decode_chunks, m, bucket_size, two_mean,
            chunk)(gathered, out, stream, status, name_hashes, expect)
