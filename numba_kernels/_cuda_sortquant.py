"""The CUDA kernels of sort quantization (launched from ``numba_kernels.cuda``), equal to
``numba_kernels.reference.sortquant_*_ref`` bit for bit.

* ``make_encode(P)``: a block per bucket of at most ``P`` elements (a power of two, at most
  ``MAX_BUCKET``) loads it into shared memory as (value, index) pairs padded with (+Inf, index),
  checks it (a non-finite value or range makes the bucket NaN), sorts the pairs with a bitonic network
  (ties in index order), and thread p quantizes the element of rank p within its group, whose (min,
  max) sit at its first and last rank. Codes go to a uint16 scratch array, the scales into the
  payload, the residual into ``residual`` (which may be ``x``: all of it is read before a barrier).
* ``k_pack``: one thread per 32-bit word of codes (any width); the padding before the scales is zero.

Written for clarity, not tuned: the encode's cost is its sort (log2(P)^2 / 2 barriers per bucket).
"""
import numpy as np
from numba import cuda, float32, int32

from ._cuda_device import SHARED, mix64, put, sortquant_level, sortquant_value, uniform24
from ._scalar import F0, FINF, FNAN

MAX_BUCKET = 4096           # shared memory: 8 bytes per element


@cuda.jit(device=True)
def sort_pairs(sval, sidx, P, tid, T):
    """Sort the P (a power of two) (value, index) pairs in shared memory by value, ties by index, with
    a bitonic network; every thread of the block calls it (it synchronises)."""
    size = 2
    while size <= P:
        stride = size >> 1
        while stride > 0:
            for p in range(tid, P, T):
                q = p ^ stride
                if q > p:
                    av = sval[p]
                    bv = sval[q]
                    ai = sidx[p]
                    bi = sidx[q]
                    greater = av > bv or (av == bv and ai > bi)
                    if greater == ((p & size) == 0):
                        sval[p] = bv
                        sval[q] = av
                        sidx[p] = bi
                        sidx[q] = ai
            cuda.syncthreads()
            stride >>= 1
        size <<= 1


def make_encode(P):
    """The encode kernel for buckets of at most ``P`` elements (shared arrays of P pairs)."""

    @cuda.jit
    def k_encode(x, scales, codes, bs, split_bits, lbits, stochastic, key, residual, has_res):
        key = mix64(key)            # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
        sval = cuda.shared.array(P, float32)
        sidx = cuda.shared.array(P, int32)
        sok = cuda.shared.array(SHARED, int32)
        smin = cuda.shared.array(SHARED, float32)
        smax = cuda.shared.array(SHARED, float32)
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        T = cuda.blockDim.x
        st = b * bs
        n = min(bs, x.size - st)
        ok = 1
        mn = FINF
        mx = -FINF
        for p in range(tid, P, T):
            if p < n:
                v = x[st + p]
                sval[p] = v
                if not abs(v) < FINF:
                    ok = 0
                mn = min(mn, v)
                mx = max(mx, v)
            else:
                sval[p] = FINF
            sidx[p] = p
        sok[tid] = ok
        smin[tid] = mn
        smax[tid] = mx
        cuda.syncthreads()
        if tid == 0:
            for t in range(1, T):
                sok[0] &= sok[t]
                smin[0] = min(smin[0], smin[t])
                smax[0] = max(smax[0], smax[t])
        cuda.syncthreads()
        G = 1 << split_bits
        L = (1 << lbits) - 1
        Lf = float32(L)
        base = 2 * G * b
        if sok[0] == 0 or not abs(smax[0] - smin[0]) < FINF:     # the same on every thread
            for k in range(tid, 2 * G, T):
                scales[base + k] = FNAN
            for p in range(tid, n, T):
                codes[st + p] = 0
                if has_res:
                    residual[st + p] = sval[p] - FNAN
            return
        sort_pairs(sval, sidx, P, tid, T)
        for g in range(tid, G, T):
            if (g * n + G - 1) // G == ((g + 1) * n + G - 1) // G:     # an empty group (n < G)
                scales[base + 2 * g] = F0
                scales[base + 2 * g + 1] = F0
        for p in range(tid, n, T):
            g = (p * G) // n
            p0 = (g * n + G - 1) // G
            p1 = ((g + 1) * n + G - 1) // G
            lo = sval[p0]
            hi = sval[p1 - 1]
            if p == p0:
                scales[base + 2 * g] = lo
                scales[base + 2 * g + 1] = hi
            unit = float32(hi - lo) / Lf
            i = st + sidx[p]
            xv = sval[p]
            r = uniform24(key, i) if stochastic else np.uint64(0)
            q = sortquant_level(xv, lo, unit, Lf, L, stochastic, r)
            codes[i] = np.uint16((g << lbits) | q)
            if has_res:
                residual[i] = xv - sortquant_value(lo, q, unit)

    return k_encode


@cuda.jit
def k_pack(codes, payload, codes_off, nwords, bits):
    """Word w of the codes (stream bits [32w, 32w + 32)) from the codes of the elements that touch
    it, written as 4 little-endian bytes."""
    numel = codes.size
    w = cuda.grid(1)
    while w < nwords:
        bit0 = w * 32
        i = bit0 // bits
        acc = np.uint64(0)
        while i < numel and i * bits < bit0 + 32:
            off = i * bits - bit0
            c = np.uint64(codes[i])
            if off >= 0:
                acc |= c << np.uint64(off)
            else:
                acc |= c >> np.uint64(-off)
            i += 1
        o = codes_off + 4 * w
        for k in range(4):
            payload[o + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
        w += cuda.gridDim.x * cuda.blockDim.x


@cuda.jit
def k_decode(payload, scales, out, codes_off, bs, split_bits, bits, accumulate, status, check):
    """out[i] (+)= lo + q * unit of element i's group; NaN where ``check`` and ``status[0] != 0``."""
    bad = check and status[0] != 0
    G = 1 << split_bits
    lbits = bits - split_bits
    L = (1 << lbits) - 1
    Lf = float32(L)
    mask = (1 << bits) - 1
    i = cuda.grid(1)
    while i < out.size:
        bp = i * bits
        o = codes_off + (bp >> 3)
        w = int32(payload[o]) | (int32(payload[o + 1]) << 8)
        if bits > 9:
            w |= int32(payload[o + 2]) << 16
        code = (w >> (bp & 7)) & mask
        g = code >> lbits
        k = 2 * G * (i // bs) + 2 * g
        lo = scales[k]
        unit = float32(scales[k + 1] - lo) / Lf
        v = FNAN if bad else sortquant_value(lo, code & L, unit)
        put(out, i, v, accumulate)
        i += cuda.gridDim.x * cuda.blockDim.x
