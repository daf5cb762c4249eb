"""Numba CPU kernels (``*_cpu``): ``njit(parallel=True, cache=True)``, bit-identical to ``*_ref``.

(Each kernel also has a serial twin, used when the input is a single chunk or Numba has one thread.)

Work is split into chunks of whole buckets whose first element is a multiple of 8 (so every chunk
writes whole code bytes and no two threads touch one byte); ``prange`` runs over the chunks. Within a
chunk the scales of its buckets are computed first, then its elements are quantized and packed while
they are still in cache: one pass over ``x`` from memory.
"""
import hashlib
import math
import os
import types

import numba
import numpy as np
from numba import njit, prange

from . import wire
from ._scalar import F0, FNAN, U8, UFF, build

__all__ = ["qsgd_encode_cpu", "qsgd_decode_cpu", "onebit_encode_cpu", "onebit_decode_cpu",
           "write_header_cpu", "chunk_buckets"]



def _invalidate_stale_cache():
    """Numba's on-disk cache only watches this file; the kernels also inline ``_scalar.py``. Drop this
    module's cache files when that changed (a stamp of its contents is kept beside the cache)."""
    here = os.path.dirname(os.path.abspath(__file__))
    cache = os.path.join(here, "__pycache__")
    try:
        with open(os.path.join(here, "_scalar.py"), "rb") as f:
            stamp = hashlib.sha256(f.read()).hexdigest()
        path = os.path.join(cache, "cpu_scalar.stamp")
        old = open(path).read() if os.path.exists(path) else None
        if old != stamp:
            for name in os.listdir(cache) if os.path.isdir(cache) else ():
                if name.startswith("cpu.") and name.endswith((".nbi", ".nbc")):
                    os.remove(os.path.join(cache, name))
            os.makedirs(cache, exist_ok=True)
            with open(path, "w") as f:
                f.write(stamp)
    except OSError:          # read-only install: Numba then caches elsewhere (or not at all)
        pass


_invalidate_stale_cache()

_inline = njit(inline="always", error_model="numpy")


@njit(inline="always")
def _fmul(a, b):
    return a * b


_ops = build(_inline, _fmul)
_qsgd_code = _ops.qsgd_code
_max_nan = _ops.max_nan
_finite = _ops.finite
_sqrt32 = _ops.sqrt32

_KERNEL = dict(cache=True, error_model="numpy", nogil=True)
_TARGET_CHUNK = 16384       # elements per parallel task


class _Kernel:
    """A kernel compiled twice from one Python function: ``parallel=True`` for inputs of several
    chunks, serial for one chunk (a parallel region costs tens of microseconds to start, more on a
    busy machine). The serial twin gets its own qualified name so the two on-disk caches never mix."""

    def __init__(self, fn):
        self.parallel = njit(parallel=True, **_KERNEL)(fn)
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"
        twin.__module__ = fn.__module__
        self.serial = njit(parallel=False, **_KERNEL)(twin)

    def __call__(self, nchunks, *args):
        return (self.parallel if nchunks > 1 and numba.get_num_threads() > 1 else self.serial)(*args)


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


@_kernel
def _qsgd_encode(x, payload, scales, header, codes_off, codes_end, scales_off, bits, bs, stochastic,
                 norm_l2, key, kchunk):
    numel = x.size
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
        codes = np.zeros(((e1 - e0 + 7) // 8) * 8, np.int64)
        for b in range(b0, b1):
            scale = scales[b]
            unit = scale / sf
            st = b * bs
            en = min(numel, st + bs)
            for i in range(st, en):
                codes[i - e0] = _qsgd_code(x[i], scale, unit, sf, s, stochastic, key, i)
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


@_kernel
def _qsgd_decode(payload, scales, out, codes_off, bits, bs, accumulate, kchunk):
    numel = out.size
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    s = (1 << (bits - 1)) - 1
    sf = np.float32(s)
    ubits = np.uint64(bits)
    mask = (np.uint64(1) << ubits) - np.uint64(1)
    for c in prange(nchunks):
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
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
def _onebit_encode(x, payload, scales, header, codes_off, codes_end, scales_off, bs, two_mean, kchunk):
    numel = x.size
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


@_kernel
def _onebit_decode(payload, scales, out, codes_off, bs, two_mean, accumulate, kchunk):
    numel = out.size
    nb = (numel + bs - 1) // bs
    nchunks = (nb + kchunk - 1) // kchunk
    for c in prange(nchunks):
        b0 = c * kchunk
        b1 = min(nb, b0 + kchunk)
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


@njit(cache=True)
def _write_header_only(payload, header):
    _write_header(payload, header)


# ---- launchers (same signatures as numba_kernels.reference) ----------------------------------------

def _check(x, payload, lay):
    if payload.size != lay.total:
        raise ValueError(f"payload has {payload.size} bytes, layout needs {lay.total} ({lay})")


def _scales_view(payload, lay, per=1):
    return payload[lay.scales_offset:lay.scales_offset + 4 * lay.nscales].view(np.float32)


def _words(header):
    return tuple(np.uint64(int(w)) for w in header)


def write_header_cpu(payload, header, stream=None):
    _write_header_only(payload, _words(header))


def qsgd_encode_cpu(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=None):
    """Bucketed QSGD encode of float32 ``x`` into ``payload`` (see ``qsgd_encode_ref``)."""
    lay = wire.layout(wire.METHODS["qsgd"], x.size, bits, bucket_size)
    _check(x, payload, lay)
    k = chunk_buckets(int(bucket_size), x.size)
    _qsgd_encode(-(-lay.nbuckets // k), x.reshape(-1), payload, _scales_view(payload, lay), _words(header), lay.codes_offset,
                 lay.codes_offset + lay.codes_nbytes, lay.scales_offset, int(bits), int(bucket_size),
                 bool(stochastic), bool(norm_l2), np.uint64(int(key)), k)


def qsgd_decode_cpu(payload, out, bits, bucket_size, accumulate, stream=None, status=None):
    """out (+)= dequantized QSGD payload (see ``qsgd_decode_ref``)."""
    lay = wire.layout(wire.METHODS["qsgd"], out.size, bits, bucket_size)
    _check(out, payload, lay)
    if out.size == 0:
        return
    k = chunk_buckets(int(bucket_size), out.size)
    _qsgd_decode(-(-lay.nbuckets // k), payload, _scales_view(payload, lay), out.reshape(-1),
                 lay.codes_offset, int(bits), int(bucket_size), bool(accumulate), k)


def onebit_encode_cpu(x, payload, header, bucket_size, two_mean, stream=None):
    """1-bit encode (see ``onebit_encode_ref``); ``bucket_size`` 0 = one bucket per tensor."""
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = wire.layout(wire.METHODS["onebit"], x.size, 1, bucket_size, mode)
    _check(x, payload, lay)
    bs = int(bucket_size) or max(x.size, 1)
    k = chunk_buckets(bs, x.size)
    _onebit_encode(-(-lay.nbuckets // k), x.reshape(-1), payload, _scales_view(payload, lay),
                   _words(header), lay.codes_offset, lay.codes_offset + lay.codes_nbytes,
                   lay.scales_offset, bs, bool(two_mean), k)


def onebit_decode_cpu(payload, out, bucket_size, two_mean, accumulate, stream=None, status=None):
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = wire.layout(wire.METHODS["onebit"], out.size, 1, bucket_size, mode)
    _check(out, payload, lay)
    if out.size == 0:
        return
    bs = int(bucket_size) or max(out.size, 1)
    k = chunk_buckets(bs, out.size)
    _onebit_decode(-(-lay.nbuckets // k), payload, _scales_view(payload, lay), out.reshape(-1),
                   lay.codes_offset, bs, bool(two_mean), bool(accumulate), k)
