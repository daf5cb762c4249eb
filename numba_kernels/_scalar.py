"""Scalar math written once, compiled for the CPU (``numba.njit``) and for CUDA (``cuda.jit(device=True)``).

:func:`build` takes the target's ``jit`` decorator and its float32 multiply (``a * b`` on the CPU,
``libdevice.fmul_rn`` on CUDA so the compiler can never contract a product and a following add into
an FMA; plain ``a * b`` in the CUDA simulator) and returns the compiled functions. The NumPy reference
(``numba_kernels.reference``) vectorises the very same operations; the tests hold all three equal bit
for bit.

Every constant is a typed NumPy scalar and every mixed-type operation is cast explicitly: Numba types
``uint64 op int64`` as float64 and ``float32 op float-literal`` as float64, which would silently change
the results.
"""
import math
from types import SimpleNamespace

import numpy as np

from .wire import VERSION

# splitmix64 (Steele, Lea, Flood 2014): golden-ratio increment and the finalizer's multipliers.
GAMMA = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
U27 = np.uint64(27)
U30 = np.uint64(30)
U31 = np.uint64(31)
U40 = np.uint64(40)
U5 = np.uint64(5)
U6 = np.uint64(6)
U32 = np.uint64(32)
U24M = np.uint64(0xFFFFFF)
U8 = np.uint64(8)
UFF = np.uint64(0xFF)
U16 = np.uint64(16)
U16M = np.uint64(0xFFFF)
M32U = np.uint64(0xFFFFFFFF)
FNV_OFFSET = np.uint64(0x811C9DC5)
FNV_PRIME = np.uint64(0x01000193)

KMEANS_SAMPLE = 1024    # values per bucket that choose KMeans's starting centroids (numba_kernels.reference)
SEGMENT = 8192          # elements per segment of a long bucket's canonical sum (numba_kernels.reference)
F0 = np.float32(0.0)
FHALF = np.float32(0.5)
F2_24 = np.float32(16777216.0)
FINF = np.float32(np.inf)
FNAN = np.float32(np.nan)


# The encode divides |x| by the bucket's unit with IEEE rounding (the reference's ``abs(x) / unit``);
# on the GPU that is a reciprocal, its refinement, a range check and a branch per element. Where the
# unit lies in [2**-60, 2**60] the CUDA encode instead computes ``y = 1 / unit`` (IEEE-rounded) once
# per bucket and per element
#     q0 = RN(a * y);  r = fma(-q0, unit, a);  q = fma(r, y, q0)
# (one Markstein correction step), which is the IEEE-rounded a / unit wherever a / unit >= 2**-40 (the
# remainder r is then representable). Below that only whether the quotient is positive matters (a
# level of 1 comes from q < 2**-24 only under stochastic rounding with 24 zero bits), and a / unit
# rounds to a positive float32 iff a > thr = RD(unit * 2**-150); so each element takes
# ``max(q, 2**-41)`` if a > thr, else 0: equal codes, without the branch. tests/test_kernels.py
# holds both facts over every float32 significand of the unit.
DIV_UNIT_MIN = np.float32(2.0 ** -60)
DIV_UNIT_MAX = np.float32(2.0 ** 60)
DIV_POS = np.float32(2.0 ** -41)      # any quotient in (0, 2**-24) gives the same code
DIV_2M50 = np.float32(2.0 ** -50)
DIV_2M100 = np.float32(2.0 ** -100)


def build(jit, fmul):
    """Compile the scalar helpers with ``jit``; ``fmul(a, b)`` is the target's uncontractable multiply."""

    @jit
    def mix64(z):
        """splitmix64 finalizer: a bijective avalanche of a uint64."""
        z = (z ^ (z >> U30)) * M1
        z = (z ^ (z >> U27)) * M2
        return z ^ (z >> U31)

    @jit
    def draw(key, i):
        """The splitmix64 draw shared by elements ``i`` and ``i ^ 32`` (``i`` and ``i + 32`` of each
        aligned group of 64 indices): ``mix64(key + p * GAMMA)`` with ``p = (i >> 6) * 32 + i % 32``."""
        ui = np.uint64(i)
        p = ((ui >> U6) << U5) | (ui & U31)
        return mix64(key + p * GAMMA)

    @jit
    def uniform24(key, i):
        """24 random bits (as a uint64 in [0, 2**24)) for element ``i`` under ``key``, counter-based:
        bits 8..31 of :func:`draw` when bit 5 of ``i`` is 0, bits 40..63 when it is 1 (one 64-bit
        hash serves two elements)."""
        z = draw(key, i)
        if np.uint64(i) & U32:
            return z >> U40
        return (z >> U8) & U24M

    @jit
    def qsgd_code(xv, scale, unit, sf, s, stochastic, key, i):
        """Offset-binary code (level + s, level in [-s, s]) of element ``xv`` (index ``i``) in a bucket of
        norm ``scale``, ``unit = scale / sf``, ``sf = float32(s)``. A zero or non-finite scale gives
        level 0 (no 0/0), which decodes to 0 or NaN."""
        r = np.uint32(0)
        if stochastic:
            r = np.uint32(uniform24(key, i))
        if not (scale > F0 and scale < FINF):
            return s
        return qsgd_level(xv, unit, sf, s, stochastic, r)

    @jit
    def qsgd_level(xv, unit, sf, s, stochastic, r):
        """:func:`qsgd_code` for a bucket whose scale is known to be positive and finite, with the
        element's 24 random bits ``r`` (uint32)."""
        return qsgd_round(abs(xv) / unit, xv < F0, sf, s, stochastic, r)

    @jit
    def round_level(v, top, stochastic, r):
        """The level of ``v`` (float32, >= 0 or NaN) clamped to ``top``: floor(v) plus, stochastic,
        (r < frac * 2**24) with ``r`` 24 random bits, else (frac >= 1/2). Branch-free."""
        if not (v <= top):           # rounding put v above top, or a unit underflowed to 0
            v = top
        # 32-bit integers (v < 2**16): on a GPU, 64-bit conversions cost several times more
        q = np.int32(v)              # v >= 0: truncation is floor
        frac = v - np.float32(q)     # exact
        if stochastic:
            q = np.int32(q + np.int32(np.float32(r) < frac * F2_24))
        else:
            q = np.int32(q + np.int32(frac >= FHALF))
        return q

    @jit
    def qsgd_round(v, negative, sf, s, stochastic, r):
        """:func:`qsgd_level` from ``v = |x| / unit`` (float32, IEEE-rounded) and the sign of x."""
        # v <= s, and v == s has no fraction to round up: the reference's min(q, s) is not needed
        q = round_level(v, sf, stochastic, r)
        sign = np.int32(1) - np.int32(2) * np.int32(negative)     # (a select and a multiply-add on a GPU)
        return np.int64(s + q * sign)

    @jit
    def max_nan(m, a):
        """max that propagates NaN whatever the order (max is order-free, so any reduction tree works)."""
        if a > m or a != a:
            return a
        return m

    @jit
    def finite(a):
        return abs(a) < FINF

    @jit
    def bucket_of(i, bs, inv_bs):
        """i // bs without a 64-bit integer division: float64 estimate, corrected by one step."""
        b = np.int64(np.float64(i) * inv_bs)
        r = i - b * bs
        if r < 0:
            b -= 1
        elif r >= bs:
            b += 1
        return b

    @jit
    def mul(a, b):
        return fmul(a, b)

    @jit
    def sortquant_level(xv, lo, unit, Lf, L, stochastic, r):
        """The level in [0, L] of ``xv`` in the SortQuant group starting at ``lo`` with step ``unit``:
        :func:`round_level` of (xv - lo) / unit, clamped to L; 0 where unit is 0 (every value is lo),
        by a select, so that a loop of it vectorises."""
        q = round_level((xv - lo) / unit, Lf, stochastic, r)
        return min(q, np.int32(L)) if unit > F0 else np.int32(0)

    @jit
    def sortquant_value(lo, q, unit):
        """What a SortQuant level decodes to: lo + q * unit, two IEEE roundings (no fused multiply-add)."""
        return lo + fmul(np.float32(q), unit)

    @jit
    def kmeans_draw(key, p):
        """The p-th sample draw of a KMeans encode under ``key``: ``mix64(key + p * GAMMA)``."""
        return mix64(key + np.uint64(p) * GAMMA)

    @jit
    def kmeans_scale(amax_bits):
        """The fixed-point scale of a KMeans bucket whose largest |x| has the bits ``amax_bits``:
        2**(157 - biased exponent), so every |x| * scale < 2**31 and 2**32 such terms fit an int64."""
        e = np.int32(amax_bits >> np.uint32(23))
        return math.ldexp(np.float64(1.0), int(np.int32(157) - e))

    @jit
    def kmeans_fixed(xv, scale):
        """``xv`` in the bucket's fixed point, truncated to an int64: sums of these are exact, in any order."""
        return np.int64(np.float64(xv) * scale)

    @jit
    def kmeans_mean(total, count, scale):
        """The centroid of ``count`` elements whose fixed-point values sum to ``total``."""
        return np.float32((np.float64(total) / np.float64(count)) / scale)

    @jit
    def kmeans_starts(srt, m, comp, cent, K):
        """cent[j] = the value of the sorted sample ``srt[:m]`` where its companded rank (the running
        float64 sum of sqrt(gap) between neighbours, kept in ``comp``) first reaches (2j + 1) / 2K of
        the total (``reference._kmeans_starts``)."""
        comp[0] = np.float64(0.0)
        for k in range(1, m):
            comp[k] = comp[k - 1] + math.sqrt(np.float64(srt[k]) - np.float64(srt[k - 1]))
        i = 0
        for j in range(K):
            t = (np.float64(2 * j + 1) * comp[m - 1]) / np.float64(2 * K)
            while i < m - 1 and comp[i] < t:
                i += 1
            cent[j] = srt[i]

    @jit
    def kmeans_mids(cent, mids):
        """The boundaries a/2 + b/2 (float32, uncontracted) between neighbouring centroids, made
        non-decreasing by a running max, so an element's centroid is the count of boundaries below it."""
        m = -FINF
        for j in range(cent.size - 1):
            m = max(m, fmul(FHALF, cent[j]) + fmul(FHALF, cent[j + 1]))
            mids[j] = m

    @jit
    def kmeans_index(mids, K, xv):
        """The centroid of ``xv``: how many of the K - 1 sorted boundaries ``mids`` are below it, by a
        binary search of log2(K) steps (ties to the lower centroid; K a power of two)."""
        j = 0
        s = K >> 1
        while s > 0:
            j += s * np.int32(mids[j + s - 1] < xv)     # branch-free: the outcome is unpredictable
            s >>= 1
        return j

    @jit
    def fnv(payload, a, b, h):
        for k in range(a, b):
            h = ((h ^ np.uint64(payload[k])) * FNV_PRIME) & M32U
        return h

    @jit
    def le_word(payload, a, b):
        """The little-endian unsigned integer held in payload[a:b] (at most 8 bytes)."""
        v = np.uint64(0)
        for k in range(a, b):
            v |= np.uint64(payload[k]) << (U8 * np.uint64(k - a))
        return v

    @jit
    def header_errors(payload, method, bits, mode, param, bucket_size, numel, name_hash, check_name):
        """``reference.header_errors_ref``, compiled."""
        err = 0
        if payload[0] != 72 or payload[1] != 86 or payload[2] != 68 or payload[3] != 81:   # b"HVDQ"
            err |= 1
        if payload[4] != VERSION:
            err |= 2
        if payload[5] != method:
            err |= 4
        if payload[6] != bits:
            err |= 8
        if payload[7] != mode:
            err |= 16
        if payload[8] != param:
            err |= 32
        if le_word(payload, 12, 16) != np.uint64(bucket_size):
            err |= 64
        if le_word(payload, 16, 24) != np.uint64(numel):
            err |= 128
        if check_name:
            if le_word(payload, 56, 60) != np.uint64(name_hash):
                err |= 256
        h = fnv(payload, 0, 62, FNV_OFFSET)
        if ((h >> U16) ^ h) & U16M != le_word(payload, 62, 64):
            err |= 512
        h = fnv(payload, 12, 16, fnv(payload, 4, 9, FNV_OFFSET))
        if ((h >> U16) ^ h) & U16M != le_word(payload, 60, 62):
            err |= 1024
        return err

    @jit
    def sqrt32(a):
        return np.float32(math.sqrt(a))

    @jit
    def onebit_scales(two_mean, p, q, cnt, ln):
        """(hi, lo): what bits 1 and 0 of a 1-bit bucket of ``ln`` elements decode to, from its canonical
        sums. two_mean: p and q the sums of the non-negatives and negatives, cnt the count of the
        non-negatives (a non-finite mean makes both NaN); mean_abs: p the sum of |x|, lo = -hi."""
        if two_mean:
            nneg = ln - cnt
            mp = F0
            mn = F0
            if cnt > 0:
                mp = p / np.float32(cnt)
            if nneg > 0:
                mn = q / np.float32(nneg)
            if not (finite(mp) and finite(mn)):
                mp = FNAN
                mn = FNAN
            return mp, mn
        m = p / np.float32(ln)
        return m, -m

    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("jit", "fmul")})   # all above


def mix64_py(z):
    """Pure-Python splitmix64 finalizer on ints (host-side key derivation)."""
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def mix64_np(z):
    """Vectorised splitmix64 finalizer on a uint64 array (wraps silently, like the kernels)."""
    z = (z ^ (z >> U30)) * M1
    z = (z ^ (z >> U27)) * M2
    return z ^ (z >> U31)
