"""Numba CPU kernels: ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``, behind one
prepared op per codec and kind (:data:`PREPARE`, reached through :func:`numba_kernels.prepare`).

Each kernel has a serial twin for inputs of one task or one Numba thread (a parallel region is slow
to start); kernels that pack codes are compiled per bit width on first use (``_cpu_base``). An op is
prepared once per configuration (layout, tasks, kernel), so a call costs little more than Numba's
dispatch.

Encodes run ``prange`` over chunks of whole buckets starting on a multiple of 8 elements
(:func:`chunk_buckets`: no two threads write one code byte), quantizing each bucket into a small code
array while it is in cache, then packing the chunk: one pass over ``x``. Decodes and the 1-bit encode
split by elements (:func:`task_span`), so that one long bucket still uses every thread. Inner loops
are written to vectorise (slices indexed from zero, integer maxima, 32 splitmix64 draws per 64
elements, codes packed through 64-bit words); each parallel task asks for 512-bit vectors (``_wide``).
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
from .reference import check_payloads, chunk_expects, chunk_ranges

__all__ = ["PREPARE", "half_encode_cpu", "half_decode_cpu", "write_header_cpu", "chunk_buckets"]


def _cached(fn):
    """``fn`` compiled serial, cached under a name holding :data:`_STAMP`."""
    return njit(cache=True)(_renamed(fn, "_" + _STAMP))


@_cached
def _write_header_only(payload, header):
    _write_header(payload, header)


@_cached
def _header_errors(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
    return _hdr_err(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name)


def _flat(a):
    return a if a.ndim == 1 else a.reshape(-1)


def _sized(a, numel, what):
    """``a`` flat, refused unless it has ``numel`` elements (_flat written out: the step's call budget)."""
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.size != numel:
        raise ValueError(f"{what} has {a.size} elements, this op was prepared for {numel}")
    return a


def half_encode_cpu(x, vals, residual=None):
    """``vals`` (uint16, x.size) = the float16 bits of float32 ``x`` (NumPy's ``astype(float16)``, bit
    for bit); ``residual`` (float32, x.size, may be ``x``), if given, = x - float32(float16(x))."""
    x = _flat(x)
    vals = _sized(vals, x.size, "vals")
    res = _NO_RESIDUAL if residual is None else _sized(residual, x.size, "residual")
    _half_encode.pick(-(-x.size // _F16_CHUNK))(x, vals, res, residual is not None, _F16_CHUNK)


def half_decode_cpu(vals, out, accumulate):
    """``out`` (float32) = (``accumulate``: +=) the float32 values of the float16 bits ``vals``."""
    out = _flat(out)
    vals = _sized(vals, out.size, "vals")
    _half_decode.pick(-(-out.size // _F16_CHUNK))(vals, out, bool(accumulate), _F16_CHUNK)


def write_header_cpu(payload, header, stream=None):
    """Writes the 8 header words into payload[:64]."""
    _write_header_only(payload, _words(header))


_WORD_ARRAYS = {}       # id(header tuple) -> (the tuple, its words as a uint64 array)


def _words(header):
    """The 8 header words as a uint64 array (Numba types it faster than a tuple of 8 scalars). Callers
    memoise their tuples per configuration, so each is converted once; the table holds the tuples, so
    an id is never reused while it is in there."""
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


def _check_expect(payload, expect):
    """Raises PayloadError naming what in ``payload``'s header differs from ``expect`` (a ``wire.Expect``)."""
    m, b, mo, no, bs, n, nh, cn = expect
    err = _header_errors(payload, m, b, mo, no, bs, n, nh, bool(cn))
    if err:
        raise wire.PayloadError(wire.describe_error_bits(int(err)))


def _bad_size(payload, total):
    return wire.PayloadError(f"payload has {payload.size} bytes, the layout needs {total}")


_NO_RESIDUAL = np.empty(0, np.float32)     # the kernels write a residual only when told to
_U64 = np.uint64


def _mode(method, two_mean):
    return wire.onebit_mode(two_mean) if method == "onebit" else 0


def _layout(method, numel, bits, bucket_size, two_mean=False, split_bits=0):
    """(layout, the kernels' bucket size) of a payload: ``bucket_size`` 0 is one bucket per tensor."""
    return (wire.layout(wire.METHODS[method], numel, bits, bucket_size, _mode(method, two_mean), split_bits),
            bucket_size or max(numel, 1))


# ---- prepared ops: built once per configuration, called every step ---------------------------------
# A call is ``self._serial or self._kernel.pick(self.nchunks)`` written out at each call site: a method
# call is a measurable part of a small launch.

class _Prepared:
    """``kernel`` with its arguments ``args`` (those between the arrays and the task size ``k``)."""
    __slots__ = ("numel", "total", "k", "nchunks", "_serial", "_kernel", "args")

    def __init__(self, kernel, numel, total, k, ntasks, args):
        self.numel, self.total, self.k, self.nchunks = numel, total, k, ntasks
        self._kernel = kernel
        self._serial = kernel.serial if ntasks <= 1 else None
        self.args = args


class _Encode(_Prepared):
    """``(x, payload, header, key, stream=None, residual=None)``: ``key`` keys the noise (1-bit:
    unused); ``residual`` (may be ``x``), if given, gets x - decode(payload). Tasks of whole buckets
    (:func:`chunk_buckets`), or with ``span`` of elements (:func:`task_span`, 1-bit)."""
    __slots__ = ()

    def __init__(self, kernel, geometry, *params, span=False):
        lay, bs = geometry
        k = (task_span if span else chunk_buckets)(bs, lay.numel)
        super().__init__(kernel, lay.numel, lay.total, k, -(-(lay.numel if span else lay.nbuckets) // k),
                         (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                          lay.nscales, bs) + params)

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        x = _sized(x, self.numel, "x")
        if payload.size != self.total:
            raise _bad_size(payload, self.total)
        res = _NO_RESIDUAL if residual is None else _sized(residual, self.numel, "residual")
        kernel = self._serial or self._kernel.pick(self.nchunks)
        kernel(x, payload, _words(header), *self.args, _U64(key), self.k, res, residual is not None)

    def bind(self, h, words):
        """The per-step call of ``Codec.bind_encode``; ``h``: the adapter's converters ``(input, payload,
        out, stream, status)``, the last two None here (so are the other ops' ``bind``)."""
        f32, pay, to_out = h[:3]
        return lambda x, payload, key, residual=None: self(f32(x), pay(payload), words, key, None,
                                                          None if residual is None else to_out(residual)[0])


class _Decode(_Prepared):
    """``(payload, out, stream=None, status=None, expect=None)``: out (+)= the payload's values;
    ``expect`` (a ``wire.Expect``) raises PayloadError before anything is written. Also the base of
    decode_sum: a decode template of ``_cpu_base``, tasks of :func:`task_span` elements."""
    __slots__ = ()

    def __init__(self, kernel, geometry, param, accumulate=None):
        lay, bs = geometry
        k = task_span(bs, lay.numel)
        super().__init__(kernel, lay.numel, lay.total, k, -(-lay.numel // k),
                         (lay.codes_offset, lay.scales_offset, lay.nscales, bs, int(param))
                         + (() if accumulate is None else (bool(accumulate),)))     # (None: decode_sum)

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _sized(out, self.numel, "out")
        if payload.size != self.total:
            raise _bad_size(payload, self.total)
        if expect is not None:
            _check_expect(payload, expect)
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payload, out, *self.args, self.k)

    def bind(self, h, expect):
        pay, to_out = h[1:3]
        return lambda payload, out: self(pay(payload), to_out(out)[0], None, None, expect)


class _DecodeSum(_Decode):
    """``(payloads, n, out, stream=None, status=None, expect=None)``: out = the sum of the ``n``
    payloads' decodes, in order."""
    __slots__ = ()

    def run(self, payloads, n, out, addend):
        """out = the sum (+ ``addend``, if not None), headers unchecked."""
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(payloads, n, self.total, out, *self.args, self.k, out if addend is None else addend,
                   addend is not None)

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        out = _sized(out, self.numel, "out")
        check_payloads(payloads, n, self.total, expect, _check_expect)
        self.run(payloads, n, out, None)

    def bind(self, h, expect):
        pay, to_out = h[1:3]
        return lambda payloads, n, out: self(pay(payloads), n, to_out(out)[0], None, None, expect)


class _ReduceRequantize:
    """``(payloads, n, residual, out_payload, header, key, stream=None, status=None, expect=None)``
    (1-bit: ``key`` is ignored). The sum (plus the residual) goes to a scratch array, then the encode
    kernel quantizes it and writes the new residual."""
    __slots__ = ("sum", "encode")

    def __init__(self, decode_sum, encode):
        self.sum, self.encode = decode_sum, encode

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        check_payloads(payloads, n, self.sum.total, expect, _check_expect)
        if residual is not None:
            residual = _sized(residual, self.sum.numel, "residual")
        c = np.empty(self.sum.numel, np.float32)
        self.sum.run(payloads, n, c, residual)
        self.encode(c, out_payload, header, key, stream, residual)

    def bind(self, h, words, expect):
        pay, to_out = h[1:3]
        return lambda payloads, n, residual, out_payload, key: self(
            pay(payloads), n, None if residual is None else to_out(residual)[0], pay(out_payload), words, key,
            None, None, expect)


class _DecodeChunks(_Prepared):
    """``(gathered, out, stream=None, status=None, name_hashes=None, expect=None)``: chunk j's payload
    decoded into ``out[j*chunk:(j+1)*chunk]``."""
    __slots__ = ("offsets", "expects_of", "_exps")

    def __init__(self, kernel, method, numel, bits, bucket_size, chunk, two_mean=False):
        ranges = chunk_ranges(numel, bucket_size, chunk)
        (full, bs), (last, _) = (_layout(method, m, bits, bucket_size, two_mean)
                                 for m in (min(chunk, numel), ranges[-1][1] - ranges[-1][0] if ranges else 0))
        self.offsets = [j * full.total for j in range(len(ranges))] + [
            (len(ranges) - 1) * full.total + last.total if ranges else 0]
        mode = _mode(method, two_mean)
        self.expects_of = lambda expect, name_hashes: chunk_expects(
            numel, bucket_size, chunk, wire.METHODS[method], bits, mode, expect, name_hashes)
        self._exps = None
        chunk = chunk if bucket_size else bs            # (no bucket size: one chunk of one bucket)
        span = task_span(bs, numel)
        super().__init__(kernel, numel, self.offsets[-1], span, len(ranges) * -(-chunk // span),
                         (chunk, full.total, full.scales_offset, full.nscales, last.total, last.scales_offset,
                          last.nscales, full.codes_offset, bs, int(two_mean)))

    def __call__(self, gathered, out, stream=None, status=None, name_hashes=None, expect=None):
        out = _sized(out, self.numel, "out")
        if gathered.size != self.total:
            raise wire.PayloadError(f"gathered has {gathered.size} bytes, the chunks need {self.total}")
        if expect is not None or name_hashes is not None:
            key = (expect, id(name_hashes))         # a caller passes the same ones every step
            exps = self._exps                       # (read once: another thread may replace it)
            if exps is None or exps[0] != key:
                exps = self._exps = (key, name_hashes, self.expects_of(expect, name_hashes))
            for j, e in enumerate(exps[2]):
                _check_expect(gathered[self.offsets[j]:self.offsets[j + 1]], e)
        if self.numel:
            kernel = self._serial or self._kernel.pick(self.nchunks)
            kernel(gathered, out, *self.args, self.k)

    def bind(self, h, name_hashes, expect):
        pay, to_out = h[1:3]
        return lambda gathered, out: self(pay(gathered), to_out(out)[0], None, None, name_hashes, expect)


def _onebit_encode_op(numel, bucket_size, two_mean):
    geometry = _layout("onebit", numel, 1, bucket_size, two_mean)
    return _Encode(_onebit_encode if geometry[1] <= SEGMENT else _onebit_encode_long, geometry,
                   bool(two_mean), span=True)


# (method, kind) -> the prepared op's factory, with the same keyword parameters as numba_kernels.cuda's
PREPARE = {
    ("qsgd", "encode"): lambda numel, bits, bucket_size, stochastic, norm_l2: _Encode(
        _qsgd_encode[bits], _layout("qsgd", numel, bits, bucket_size), bool(stochastic), bool(norm_l2)),
    ("qsgd", "decode"): lambda numel, bits, bucket_size, accumulate: _Decode(
        _qsgd_decode[bits], _layout("qsgd", numel, bits, bucket_size), 0, accumulate),
    ("qsgd", "decode_sum"): lambda numel, bits, bucket_size: _DecodeSum(
        _qsgd_decode_sum[bits], _layout("qsgd", numel, bits, bucket_size), 0),
    ("qsgd", "reduce_requantize"): lambda numel, bits, bucket_size, stochastic, norm_l2: _ReduceRequantize(
        PREPARE["qsgd", "decode_sum"](numel, bits, bucket_size),
        PREPARE["qsgd", "encode"](numel, bits, bucket_size, stochastic, norm_l2)),
    ("qsgd", "decode_chunks"): lambda numel, bits, bucket_size, chunk: _DecodeChunks(
        _qsgd_decode_chunks[bits], "qsgd", numel, bits, bucket_size, chunk),
    ("onebit", "encode"): _onebit_encode_op,
    ("onebit", "decode"): lambda numel, bucket_size, two_mean, accumulate: _Decode(
        _onebit_decode, _layout("onebit", numel, 1, bucket_size, two_mean), two_mean, accumulate),
    ("onebit", "decode_sum"): lambda numel, bucket_size, two_mean: _DecodeSum(
        _onebit_decode_sum, _layout("onebit", numel, 1, bucket_size, two_mean), two_mean),
    ("onebit", "reduce_requantize"): lambda numel, bucket_size, two_mean: _ReduceRequantize(
        PREPARE["onebit", "decode_sum"](numel, bucket_size, two_mean),
        _onebit_encode_op(numel, bucket_size, two_mean)),
    ("onebit", "decode_chunks"): lambda numel, bucket_size, two_mean, chunk: _DecodeChunks(
        _onebit_decode_chunks, "onebit", numel, 1, bucket_size, chunk, bool(two_mean)),
    ("sortquant", "encode"): lambda numel, bits, split_bits, bucket_size, stochastic: _Encode(
        _sortquant_encode[bits], _layout("sortquant", numel, bits, bucket_size, split_bits=split_bits),
        split_bits, bool(stochastic)),
    ("sortquant", "decode"): lambda numel, bits, split_bits, bucket_size, accumulate: _Decode(
        _sortquant_decode[bits], _layout("sortquant", numel, bits, bucket_size, split_bits=split_bits),
        split_bits, accumulate),
    ("kmeans", "encode"): lambda numel, bits, bucket_size, iters: _Encode(
        _kmeans_encode[bits], _layout("kmeans", numel, bits, bucket_size), iters),
    ("kmeans", "decode"): lambda numel, bits, bucket_size, accumulate: _Decode(
        _kmeans_decode[bits], _layout("kmeans", numel, bits, bucket_size), 0, accumulate),
}
