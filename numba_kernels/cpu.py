"""Numba CPU kernels (``*_cpu``): ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``.

Each kernel also has a serial twin, used when the input is a single chunk or Numba has one thread (a
parallel region costs tens of microseconds to start). Launches are prepared once per configuration
(``prepare_*``: layout, chunking and kernel choice computed once; the plain ``*_cpu`` launchers keep
them in a small cache keyed by ints), so a call costs little more than Numba's dispatch.

Work is split into chunks of whole buckets whose first element is a multiple of 8 (so every chunk
writes whole code bytes and no two threads touch one byte); ``prange`` runs over the chunks. Within a
chunk the scales of its buckets are computed first, then its elements are quantized and packed while
they are still in cache: one pass over ``x`` from memory.
"""
import functools
import hashlib
import math
import os
import types

import numba
import numpy as np
from numba import njit, prange

from . import wire
from ._memo import memo
from ._scalar import F0, FNAN, GAMMA, U8, U24M, U40, UFF, build

__all__ = ["qsgd_encode_cpu", "qsgd_decode_cpu", "onebit_encode_cpu", "onebit_decode_cpu",
           "write_header_cpu", "chunk_buckets", "prepare_qsgd_encode", "prepare_qsgd_decode",
           "prepare_onebit_encode", "prepare_onebit_decode", "header_errors_cpu",
           "qsgd_decode_sum_cpu", "onebit_decode_sum_cpu", "qsgd_reduce_requantize_cpu",
           "onebit_reduce_requantize_cpu", "qsgd_decode_chunks_cpu", "onebit_decode_chunks_cpu",
           "prepare_qsgd_decode_sum", "prepare_onebit_decode_sum", "prepare_qsgd_reduce_requantize",
           "prepare_onebit_reduce_requantize", "prepare_qsgd_decode_chunks",
           "prepare_onebit_decode_chunks"]



def _scalar_stamp():
    """A short hash of ``_scalar.py``, folded into every cached kernel's qualified name: Numba's on-disk
    cache only watches this file's timestamp, and the kernels inline ``_scalar.py``, so a change there
    must select other cache entries (nothing is written here; Numba's cache honours NUMBA_CACHE_DIR)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scalar.py"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


_STAMP = _scalar_stamp()

_inline = njit(inline="always", error_model="numpy")


@njit(inline="always")
def _fmul(a, b):
    return a * b


_ops = build(_inline, _fmul)
_qsgd_code_r = _ops.qsgd_code_r
_mix64 = _ops.mix64
_max_nan = _ops.max_nan
_finite = _ops.finite
_sqrt32 = _ops.sqrt32
_hdr_err = _ops.header_errors

_KERNEL = dict(cache=True, error_model="numpy", nogil=True)
_TARGET_CHUNK = 16384       # elements per parallel task


def _renamed(fn, suffix):
    """``fn`` under another qualified name (Numba's cache files are named after it)."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__,
                              fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + suffix
    twin.__module__ = fn.__module__
    return twin


class _Kernel:
    """A kernel compiled twice from one Python function: ``parallel=True`` for inputs of several
    chunks, serial for one chunk. Both carry the hash of ``_scalar.py`` in their qualified names, so
    their on-disk caches never mix with each other or with a build from another ``_scalar.py``."""

    def __init__(self, fn):
        self.parallel = njit(parallel=True, **_KERNEL)(_renamed(fn, "_par_" + _STAMP))
        self.serial = njit(parallel=False, **_KERNEL)(_renamed(fn, "_ser_" + _STAMP))

    def pick(self, nchunks):
        return self.parallel if nchunks > 1 and numba.get_num_threads() > 1 else self.serial


def _kernel(fn):
    return _Kernel(fn)


def chunk_buckets(bucket_size, numel):
    """Buckets per parallel chunk: a multiple of 8 / gcd(bucket_size, 8), about 16k elements."""
    g = 8 // math.gcd(bucket_size, 8)
    per = max(1, _TARGET_CHUNK // (g * bucket_size))
    return g * per


@_inline
def _tree(p):
    stride = 16
    while stride > 0:
        for l in range(stride):
            p[l] = p[l] + p[l + stride]
        stride //= 2
    return p[0]


@_inline
def _lanes_zero(p):
    for l in range(32):
        p[l] = F0


@_inline
def _sum_kind(x, st, en, kind, p, q):
    """Canonical lane sums of the bucket x[st:en]. kind 1: x*x into p; 2: x>=0 into p, x<0 into q
    (returns the count of x>=0); 3: |x| into p."""
    _lanes_zero(p)
    _lanes_zero(q)
    npos = 0
    n = en - st
    full = n // 32
    for r in range(full + 1):
        base = st + r * 32
        m = 32 if r < full else n - full * 32
        for l in range(m):
            v = x[base + l]
            if kind == 1:
                p[l] = p[l] + v * v
            elif kind == 2:
                # branch-free: adding +0.0 leaves a partial sum unchanged, bit for bit (partials
                # start at +0.0, so none is -0.0)
                pos = v >= F0
                p[l] = p[l] + (v if pos else F0)
                q[l] = q[l] + (F0 if pos else v)
                npos += np.int64(pos)
            else:
                p[l] = p[l] + abs(v)
    return npos


@_inline
def _write_header(payload, header):
    for k in range(64):
        payload[k] = np.uint8((header[k >> 3] >> (U8 * np.uint64(k & 7))) & UFF)


@_inline
def _uniforms(key, e0, e1, r):
    """r[i - e0] = the 24 random bits of element i in [e0, e1) (``_scalar.uniform24``), one splitmix64
    draw per pair i, i + 32 of each aligned group of 64."""
    for g in range(e0 >> 6, (e1 + 63) >> 6):
        base = g << 6
        for l in range(32):
            z = _mix64(key + np.uint64(g * 32 + l) * GAMMA)
            i = base + l
            if i >= e0 and i < e1:
                r[i - e0] = np.uint32((z >> U8) & U24M)
            i += 32
            if i >= e0 and i < e1:
                r[i - e0] = np.uint32(z >> U40)


@_kernel
def _qsgd_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bits, bs, stochastic,
                 norm_l2, key, kchunk, residual, has_res):
    numel = x.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    s = (1 << (bits - 1)) - 1
    sf = np.float32(s)
    for c in prange(nchunks):
        p = np.empty(32, np.float32)
        q = np.empty(32, np.float32)
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
        for b in range(b0, b1):
            st = b * bs
            en = min(numel, st + bs)
            if norm_l2:
                _sum_kind(x, st, en, 1, p, q)
                scales[b] = _sqrt32(_tree(p))
            else:
                m = F0
                for ix in range(st, en):
                    m = _max_nan(m, abs(x[ix]))
                scales[b] = m
        # quantize bucket by bucket (a loop the compiler vectorises), then pack one group of 8
        # elements (exactly ``bits`` bytes) at a time
        e0 = b0 * bs
        e1 = min(numel, b1 * bs)
        r = np.zeros(e1 - e0 if stochastic else 0, np.uint32)
        if stochastic:
            _uniforms(key, e0, e1, r)
        codes = np.zeros(((e1 - e0 + 7) // 8) * 8, np.int64)
        for b in range(b0, b1):
            scale = scales[b]
            unit = scale / sf
            st = b * bs
            en = min(numel, st + bs)
            for i in range(st, en):
                ri = r[i - e0] if stochastic else np.uint32(0)
                codes[i - e0] = _qsgd_code_r(x[i], scale, unit, sf, s, stochastic, ri)
            if has_res:
                # what the decode writes: float32(code - s) * unit (x[i] is read before residual[i]
                # is written: residual may be x)
                for i in range(st, en):
                    residual[i] = x[i] - np.float32(codes[i - e0] - s) * unit
        for g in range(codes.size // 8):
            lo = np.uint64(0)
            hi = np.uint64(0)
            for k in range(8):
                uc = np.uint64(codes[g * 8 + k])
                off = k * bits
                if off < 64:
                    lo |= uc << np.uint64(off)
                    if off + bits > 64:
                        hi |= uc >> np.uint64(64 - off)
                else:
                    hi |= uc << np.uint64(off - 64)
            base = codes_off + (e0 // 8 + g) * bits
            nbytes = min(bits, codes_end - base)
            for j in range(nbytes):
                if j < 8:
                    payload[base + j] = np.uint8((lo >> (U8 * np.uint64(j))) & UFF)
                else:
                    payload[base + j] = np.uint8((hi >> (U8 * np.uint64(j - 8))) & UFF)


@_inline
def _qsgd_dec_range(payload, out, codes_off, scales, bits, bs, b0, b1, accumulate):
    """out[i] (+)= the value of element i of a QSGD payload, for the elements of buckets [b0, b1)."""
    numel = out.size
    s = (1 << (bits - 1)) - 1
    sf = np.float32(s)
    ubits = np.uint64(bits)
    mask = (np.uint64(1) << ubits) - np.uint64(1)
    e0 = b0 * bs
    e1 = min(numel, b1 * bs)
    pos = codes_off + (e0 * bits) // 8
    acc = np.uint64(0)
    nacc = np.uint64(0)
    b = b0
    bend = min(numel, (b + 1) * bs)
    unit = scales[b] / sf
    for i in range(e0, e1):
        if i >= bend:
            b += 1
            bend = min(numel, bend + bs)
            unit = scales[b] / sf
        while nacc < ubits:
            acc |= np.uint64(payload[pos]) << nacc
            pos += 1
            nacc += U8
        code = np.int64(acc & mask)
        acc >>= ubits
        nacc -= ubits
        val = np.float32(code - s) * unit
        if accumulate:
            out[i] = out[i] + val
        else:
            out[i] = val


@_kernel
def _qsgd_decode(payload, out, codes_off, scales_off, nscales, bits, bs, accumulate, kchunk):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        b0 = c * kchunk
        _qsgd_dec_range(payload, out, codes_off, scales, bits, bs, b0, min(nb, b0 + kchunk), accumulate)


@_kernel
def _qsgd_decode_sum(payloads, npay, total, out, codes_off, scales_off, nscales, bits, bs, kchunk,
                     addend, has_add):
    """out = the float32 sum of the npay payloads' decodes, in payload order (+ addend[i] last)."""
    numel = out.size
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
        for k in range(npay):
            p = payloads[k * total:(k + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
            _qsgd_dec_range(p, out, codes_off, scales, bits, bs, b0, b1, k > 0)
        if has_add:
            for i in range(b0 * bs, min(numel, b1 * bs)):
                out[i] = out[i] + addend[i]


@_kernel
def _qsgd_decode_chunks(gathered, out, chunk, total, scales_off, nscales, last_total, last_scales_off,
                        last_nscales, codes_off, bits, bs, kchunk):
    """Chunk j's payload (at j*total in gathered) decoded into out[j*chunk:(j+1)*chunk]; the last
    chunk has its own layout (last_*)."""
    numel = out.size
    nch = (numel + chunk - 1) // chunk
    per = (chunk // bs + kchunk - 1) // kchunk          # tasks per full chunk
    for t in prange(nch * per):
        j = t // per
        c = t - j * per
        a = j * chunk
        o = out[a:min(numel, a + chunk)]
        if j == nch - 1:
            p = gathered[j * total:j * total + last_total]
            scales = p[last_scales_off:last_scales_off + 4 * last_nscales].view(np.float32)
        else:
            p = gathered[j * total:(j + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
        nb = (o.size + bs - 1) // bs
        b0 = c * kchunk
        if b0 < nb:
            _qsgd_dec_range(p, o, codes_off, scales, bits, bs, b0, min(nb, b0 + kchunk), False)


@_kernel
def _onebit_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, two_mean, kchunk,
                   residual, has_res):
    numel = x.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    _write_header(payload, header)
    for k in range(codes_end, scales_off):
        payload[k] = 0
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        p = np.empty(32, np.float32)
        q = np.empty(32, np.float32)
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
        for b in range(b0, b1):
            st = b * bs
            en = min(numel, st + bs)
            if two_mean:
                npos = _sum_kind(x, st, en, 2, p, q)
                nneg = (en - st) - npos
                mp = _tree(p) / np.float32(npos) if npos > 0 else F0
                mn = _tree(q) / np.float32(nneg) if nneg > 0 else F0
                if not (_finite(mp) and _finite(mn)):
                    mp = FNAN
                    mn = FNAN
                scales[2 * b] = mp
                scales[2 * b + 1] = mn
            else:
                _sum_kind(x, st, en, 3, p, q)
                scales[b] = _tree(p) / np.float32(en - st)
        e0 = b0 * bs
        e1 = min(numel, b1 * bs)
        pos = codes_off + e0 // 8
        acc = 0
        nacc = 0
        for i in range(e0, e1):
            acc |= np.int64(x[i] >= F0) << nacc
            nacc += 1
            if nacc == 8:
                payload[pos] = np.uint8(acc)
                pos += 1
                acc = 0
                nacc = 0
        if nacc > 0:
            payload[pos] = np.uint8(acc)
        if has_res:
            # what the decode writes for the bit (x >= 0) of each element
            for b in range(b0, b1):
                st = b * bs
                en = min(numel, st + bs)
                if two_mean:
                    hi = scales[2 * b]
                    lo = scales[2 * b + 1]
                else:
                    hi = scales[b]
                    lo = -hi
                for i in range(st, en):
                    v = x[i]
                    residual[i] = v - (hi if v >= F0 else lo)


@_inline
def _onebit_dec_range(payload, out, codes_off, scales, bs, two_mean, b0, b1, accumulate):
    """out[i] (+)= the value of element i of a 1-bit payload, for the elements of buckets [b0, b1)."""
    numel = out.size
    e0 = b0 * bs
    e1 = min(numel, b1 * bs)
    b = b0
    bend = min(numel, (b + 1) * bs)
    for i in range(e0, e1):
        if i >= bend:
            b += 1
            bend = min(numel, bend + bs)
        bit = (payload[codes_off + (i >> 3)] >> (i & 7)) & 1
        if two_mean:
            val = scales[2 * b] if bit else scales[2 * b + 1]
        else:
            val = scales[b] if bit else -scales[b]
        if accumulate:
            out[i] = out[i] + val
        else:
            out[i] = val


@_kernel
def _onebit_decode(payload, out, codes_off, scales_off, nscales, bs, two_mean, accumulate, kchunk):
    numel = out.size
    scales = payload[scales_off:scales_off + 4 * nscales].view(np.float32)
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        b0 = c * kchunk
        _onebit_dec_range(payload, out, codes_off, scales, bs, two_mean, b0, min(nb, b0 + kchunk),
                          accumulate)


@_kernel
def _onebit_decode_sum(payloads, npay, total, out, codes_off, scales_off, nscales, bs, two_mean, kchunk,
                       addend, has_add):
    numel = out.size
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
        for k in range(npay):
            p = payloads[k * total:(k + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
            _onebit_dec_range(p, out, codes_off, scales, bs, two_mean, b0, b1, k > 0)
        if has_add:
            for i in range(b0 * bs, min(numel, b1 * bs)):
                out[i] = out[i] + addend[i]


@_kernel
def _onebit_decode_chunks(gathered, out, chunk, total, scales_off, nscales, last_total, last_scales_off,
                          last_nscales, codes_off, bs, two_mean, kchunk):
    numel = out.size
    nch = (numel + chunk - 1) // chunk
    per = (chunk // bs + kchunk - 1) // kchunk
    for t in prange(nch * per):
        j = t // per
        c = t - j * per
        a = j * chunk
        o = out[a:min(numel, a + chunk)]
        if j == nch - 1:
            p = gathered[j * total:j * total + last_total]
            scales = p[last_scales_off:last_scales_off + 4 * last_nscales].view(np.float32)
        else:
            p = gathered[j * total:(j + 1) * total]
            scales = p[scales_off:scales_off + 4 * nscales].view(np.float32)
        nb = (o.size + bs - 1) // bs
        b0 = c * kchunk
        if b0 < nb:
            _onebit_dec_range(p, o, codes_off, scales, bs, two_mean, b0, min(nb, b0 + kchunk), False)


def _write_header_only(payload, header):
    _write_header(payload, header)


def _header_errors(payload, method, bits, mode, norm, bucket_size, numel, name_hash, check_name):
    return _hdr_err(payload, method, bits, mode, norm, bucket_size, numel, name_hash, check_name)


_header_errors = njit(cache=True)(_renamed(_header_errors, "_" + _STAMP))
_write_header_only = njit(cache=True)(_renamed(_write_header_only, "_" + _STAMP))


# ---- launchers (same signatures as numba_kernels.reference) ----------------------------------------

_U64 = np.uint64


def _words(header):
    if type(header) is tuple and len(header) == 8 and type(header[0]) is _U64:
        return header
    return tuple(_U64(int(w)) for w in header)


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

    def _setup(self, kernel, lay, bs):
        self.numel = lay.numel
        self.total = lay.total
        self.k = chunk_buckets(bs, lay.numel)
        self.nchunks = -(-lay.nbuckets // self.k)
        self._kernel = kernel
        self._serial = kernel.serial if self.nchunks <= 1 else None

    def _pick(self):
        return self._serial if self._serial is not None else self._kernel.pick(self.nchunks)


class QsgdEncodeCPU(_PreparedBase):
    """``prepare_qsgd_encode(...)(x, payload, header, key, stream=None, residual=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bits, bucket_size, stochastic, norm_l2):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_encode, lay, bucket_size)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, int(bits), int(bucket_size), bool(stochastic), bool(norm_l2))

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        self._pick()(x, payload, _words(header), *self.args, _U64(key), self.k, res, has)


class QsgdDecodeCPU(_PreparedBase):
    """``prepare_qsgd_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bits, bucket_size, accumulate):
        lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
        self._setup(_qsgd_decode, lay, bucket_size)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bits), int(bucket_size),
                     bool(accumulate))

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        _check_size(payload, self.total)
        _check_expect(payload, expect)
        if self.numel:
            self._pick()(payload, out, *self.args, self.k)


class OnebitEncodeCPU(_PreparedBase):
    """``prepare_onebit_encode(...)(x, payload, header, stream=None, residual=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bucket_size, two_mean):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_encode, lay, bs)
        self.args = (lay.codes_offset, lay.codes_offset + lay.codes_nbytes, lay.scales_offset,
                     lay.nscales, bs, bool(two_mean))

    def __call__(self, x, payload, header, stream=None, residual=None):
        x = _flat(x)
        if x.size != self.numel:
            raise ValueError(f"x has {x.size} elements, this launch was prepared for {self.numel}")
        _check_size(payload, self.total)
        if residual is None:
            res, has = _NO_RESIDUAL, False
        else:
            res, has = _flat(residual), True
            if res.size != self.numel:
                raise ValueError(f"residual has {res.size} elements, x has {self.numel}")
        self._pick()(x, payload, _words(header), *self.args, self.k, res, has)


class OnebitDecodeCPU(_PreparedBase):
    """``prepare_onebit_decode(...)(payload, out, stream=None, status=None, expect=None)``."""
    __slots__ = ("args",)

    def __init__(self, numel, bucket_size, two_mean, accumulate):
        mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
        bs = int(bucket_size) or max(numel, 1)
        self._setup(_onebit_decode, lay, bs)
        self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean),
                     bool(accumulate))

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        out = _flat(out)
        if out.size != self.numel:
            raise ValueError(f"out has {out.size} elements, this launch was prepared for {self.numel}")
        _check_size(payload, self.total)
        _check_expect(payload, expect)
        if self.numel:
            self._pick()(payload, out, *self.args, self.k)


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


def onebit_encode_cpu(x, payload, header, bucket_size, two_mean, stream=None, residual=None):
    """1-bit encode (see ``onebit_encode_ref``); ``bucket_size`` 0 = one bucket per tensor."""
    n = x.size
    _cached((2, n, bucket_size, two_mean), prepare_onebit_encode, n, bucket_size, two_mean)(
        x, payload, header, stream, residual)


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
        self._setup(_qsgd_decode_sum if self.qsgd else _onebit_decode_sum, lay, bs)
        if self.qsgd:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, int(bits), bs)
        else:
            self.args = (lay.codes_offset, lay.scales_offset, lay.nscales, bs, bool(two_mean))

    def _run(self, payloads, n, out, addend):
        if self.numel:
            has = addend is not None
            self._pick()(payloads, n, self.total, out, *self.args, self.k, addend if has else out, has)

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
        if two_mean is None:
            enc = QsgdEncodeCPU(numel, bits, bucket_size, stochastic, norm_l2)
            self.encode = enc
        else:
            enc = OnebitEncodeCPU(numel, bucket_size, two_mean)
            self.encode = lambda x, p, h, key, stream, residual: enc(x, p, h, stream, residual)

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
        kchunk = chunk_buckets(bs, numel)
        if not bucket_size:
            chunk = bs                                   # one chunk of one bucket
        self.kchunk = kchunk
        self.ntasks = len(ranges) * -(-(chunk // bs) // kchunk)
        common = (chunk, full.total, full.scales_offset, full.nscales, last.total, last.scales_offset,
                  last.nscales, full.codes_offset)
        self.args = common + ((int(bits), bs) if qsgd else (bs, bool(two_mean)))
        self._kernel = _qsgd_decode_chunks if qsgd else _onebit_decode_chunks
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
            if self._exps is None or self._exps[0] != key:
                self._exps = (key, name_hashes, chunk_expects(self.numel, self.bs0, self.chunk, self.method,
                                                              self.bits, self.mode, expect, name_hashes))
            for j, e in enumerate(self._exps[2]):
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
