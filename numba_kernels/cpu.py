"""Numba CPU kernels: ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``, behind one
prepared op per codec and kind (:data:`PREPARE`, reached through :func:`numba_kernels.prepare`).

Each kernel also has a serial twin, used when the input is a single chunk or Numba has one thread (a
parallel region is slow to start). QSGD kernels are compiled per bit width (on its
first use), so every shift and mask is a constant. An op is prepared once per configuration (layout,
chunking and kernel choice computed once), so a call costs little more than Numba's dispatch.

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
from ._scalar import SEGMENT
from .reference import chunk_expects, chunk_ranges

__all__ = ["PREPARE", "half_encode_cpu", "half_decode_cpu", "write_header_cpu", "header_errors_cpu",
           "chunk_buckets"]


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


def write_header_cpu(payload, header, stream=None):
    """Writes the 8 header words into payload[:64]."""
    _write_header_only(payload, _words(header))


def _write_header_only(payload, header):
    _write_header(payload, header)


def _header_errors(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
    return _hdr_err(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name)


_header_errors = njit(cache=True)(_renamed(_header_errors, "_" + _STAMP))
_write_header_only = njit(cache=True)(_renamed(_write_header_only, "_" + _STAMP))


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


# ---- prepared ops: built once per configuration, called every step ---------------------------------
# A call is ``self._serial or self._kernel.pick(self.nchunks)`` written out at each call site: a method
# call is a measurable part of a small launch.

class _Prepared:
    __slots__ = ("numel", "total", "k", "nchunks", "_serial", "_kernel", "args")

    def __init__(self, kernel, lay, bs, args, span=False):
        """``k``: the kernel's task size, buckets (:func:`chunk_buckets`), or elements with ``span``
        (:func:`task_span`, the 1-bit and KMeans decode kernels); ``args``: the kernel's arguments
        between the arrays and ``k``."""
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
        self.args = args


def _wrong_size(what, size, numel):
    return ValueError(f"{what} has {size} elements, this op was prepared for {numel}")


class _Encode(_Prepared):
    """``(x, payload, header, key, stream=None, residual=None)``: ``key`` keys the noise (1-bit:
    unused); ``residual`` (may be ``x``), if given, gets x - decode(payload)."""
    __slots__ = ("keyed",)

    def __init__(self, kernel, lay, bs, args, span=False, keyed=True):
        super().__init__(kernel, lay, bs, args, span)
        self.keyed = keyed

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise _wrong_size("x", x.size, self.numel)
        if payload.size != self.total:
            _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise _wrong_size("residual", res.size, self.numel)
        kernel = self._serial or self._kernel.pick(self.nchunks)
        if self.keyed:
            kernel(x, payload, _words(header), *self.args, _U64(key), self.k, res, has)
        else:
            kernel(x, payload, _words(header), *self.args, self.k, res, has)


class _Decode(_Prepared):
    """``(payload, out, stream=None, status=None, expect=None)``: out (+)= the payload's values;
    ``expect`` (a ``wire.Expect``) raises PayloadError before anything is written."""
    __slots__ = ()

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise _wrong_size("out", out.size, self.numel)
        if payload.size != self.total:
            _check_size(payload, self.total)
        if expect is not None:
            _check_expect(payload, expect)
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payload, out, *self.args, self.k)


def _encode_args(lay, *rest):
    return (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset, lay.nscales) + rest


def _qsgd_encode_op(numel, bits, bucket_size, stochastic, norm_l2):
    lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
    return _Encode(_qsgd_encode[bits], lay, bucket_size,
                   _encode_args(lay, bucket_size, bool(stochastic), bool(norm_l2)))


def _qsgd_decode_op(numel, bits, bucket_size, accumulate):
    lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
    return _Decode(_qsgd_decode[bits], lay, bucket_size,
                   (lay.codes_offset, lay.scales_offset, lay.nscales, bucket_size, bool(accumulate)))


def _onebit_layout(numel, bucket_size, two_mean):
    """(layout, bucket size the kernels use: 0 is one bucket per tensor) of 1-bit payloads."""
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    return wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode), bucket_size or max(numel, 1)


def _onebit_encode_op(numel, bucket_size, two_mean):
    lay, bs = _onebit_layout(numel, bucket_size, two_mean)
    return _Encode(_onebit_encode if bs <= SEGMENT else _onebit_encode_long, lay, bs,
                   _encode_args(lay, bs, bool(two_mean)), span=True, keyed=False)


def _onebit_decode_op(numel, bucket_size, two_mean, accumulate):
    lay, bs = _onebit_layout(numel, bucket_size, two_mean)
    return _Decode(_onebit_decode, lay, bs,
                   (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean), bool(accumulate)),
                   span=True)


def _sortquant_encode_op(numel, bits, split_bits, bucket_size, stochastic):
    lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
    return _Encode(_sortquant_encode[bits], lay, bucket_size,
                   _encode_args(lay, bucket_size, split_bits, bool(stochastic)))


def _sortquant_decode_op(numel, bits, split_bits, bucket_size, accumulate):
    lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
    return _Decode(_sortquant_decode[bits], lay, bucket_size,
                   (lay.codes_offset, lay.scales_offset, lay.nscales, bucket_size, split_bits, bool(accumulate)))


def _kmeans_encode_op(numel, bits, bucket_size, iters):
    """``bucket_size`` 0: one bucket per tensor."""
    lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
    bs = bucket_size or max(numel, 1)
    return _Encode(_kmeans_encode[bits], lay, bs, _encode_args(lay, bs, iters))


def _kmeans_decode_op(numel, bits, bucket_size, accumulate):
    lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
    bs = bucket_size or max(numel, 1)
    return _Decode(_kmeans_decode[bits], lay, bs,
                   (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(accumulate)), span=True)


# ---- fused operations (see numba_kernels.reference): several payloads per call ------------------------

def _method_layout(numel, bits, bucket_size, two_mean):
    """(layout, bucket size used by the kernels) of QSGD (``two_mean`` None) or 1-bit payloads."""
    if two_mean is None:
        return wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size), bucket_size
    return _onebit_layout(numel, bucket_size, two_mean)


def _check_all(payloads, n, total, expect):
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    if payloads.size != n * total:
        raise wire.PayloadError(f"payloads has {payloads.size} bytes, {n} payloads of {total} need "
                                f"{n * total}")
    if expect is not None:
        for k in range(n):
            _check_expect(payloads[k * total:(k + 1) * total], expect)


class _DecodeSum(_Prepared):
    """``(payloads, n, out, stream=None, status=None, expect=None)``: out = the sum of the ``n``
    payloads' decodes, in order."""
    __slots__ = ()

    def __init__(self, numel, bits, bucket_size, two_mean):
        lay, bs = _method_layout(numel, bits, bucket_size, two_mean)
        if two_mean is None:
            super().__init__(_qsgd_decode_sum[bits], lay, bs, (lay.codes_offset, lay.scales_offset, lay.nscales, bs))
        else:
            super().__init__(_onebit_decode_sum, lay, bs,
                             (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean)), span=True)

    def _run(self, payloads, n, out, addend):
        if self.numel:
            has = addend is not None
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payloads, n, self.total, out, *self.args, self.k, addend if has else out, has)

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise _wrong_size("out", out.size, self.numel)
        _check_all(payloads, n, self.total, expect)
        self._run(payloads, n, out, None)


class _ReduceRequantize:
    """``(payloads, n, residual, out_payload, header, key, stream=None, status=None, expect=None)``
    (1-bit: ``key`` is ignored). The sum (plus the residual) goes to a scratch array, then the encode
    kernel quantizes it and writes the new residual."""
    __slots__ = ("numel", "sum", "encode")

    def __init__(self, numel, bits, bucket_size, two_mean, stochastic=False, norm_l2=False):
        self.numel = numel
        self.sum = _DecodeSum(numel, bits, bucket_size, two_mean)
        self.encode = (_qsgd_encode_op(numel, bits, bucket_size, stochastic, norm_l2) if two_mean is None
                       else _onebit_encode_op(numel, bucket_size, two_mean))

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        _check_all(payloads, n, self.sum.total, expect)
        _check_size(out_payload, self.sum.total)
        if residual is not None:
            residual = _flat(residual)
            if residual.size != self.numel:
                raise _wrong_size("residual", residual.size, self.numel)
        c = np.empty(self.numel, np.float32)
        self.sum._run(payloads, n, c, residual)
        self.encode(c, out_payload, header, key, stream, residual)


class _DecodeChunks:
    """``(gathered, out, stream=None, status=None, name_hashes=None, expect=None)``: chunk j's payload
    decoded into ``out[j*chunk:(j+1)*chunk]``."""
    __slots__ = ("numel", "total", "offsets", "method", "bits", "mode", "bs0", "chunk", "args",
                 "_kernel", "_serial", "ntasks", "kchunk", "_exps")

    def __init__(self, numel, bits, bucket_size, chunk, two_mean):
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
        out = _flat(out)
        if out.size != self.numel:
            raise _wrong_size("out", out.size, self.numel)
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


# (method, kind) -> the prepared op's factory, with the same keyword parameters as numba_kernels.cuda's
PREPARE = {
    ("qsgd", "encode"): _qsgd_encode_op,
    ("qsgd", "decode"): _qsgd_decode_op,
    ("qsgd", "decode_sum"): lambda numel, bits, bucket_size: _DecodeSum(numel, bits, bucket_size, None),
    ("qsgd", "reduce_requantize"): lambda numel, bits, bucket_size, stochastic, norm_l2: _ReduceRequantize(
        numel, bits, bucket_size, None, stochastic, norm_l2),
    ("qsgd", "decode_chunks"): lambda numel, bits, bucket_size, chunk: _DecodeChunks(
        numel, bits, bucket_size, chunk, None),
    ("onebit", "encode"): _onebit_encode_op,
    ("onebit", "decode"): _onebit_decode_op,
    ("onebit", "decode_sum"): lambda numel, bucket_size, two_mean: _DecodeSum(numel, 1, bucket_size,
                                                                                bool(two_mean)),
    ("onebit", "reduce_requantize"): lambda numel, bucket_size, two_mean: _ReduceRequantize(
        numel, 1, bucket_size, bool(two_mean)),
    ("onebit", "decode_chunks"): lambda numel, bucket_size, two_mean, chunk: _DecodeChunks(
        numel, 1, bucket_size, chunk, bool(two_mean)),
    ("sortquant", "encode"): _sortquant_encode_op,
    ("sortquant", "decode"): _sortquant_decode_op,
    ("kmeans", "encode"): _kmeans_encode_op,
    ("kmeans", "decode"): _kmeans_decode_op,
}
