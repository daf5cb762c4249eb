"""float16 conversion kernels (the FP16 codec): round to nearest even, bit for bit as NumPy.
"""
import numpy as np
from numba import prange

from ._cpu_base import _Kernel, _inline, _put, _wide


_H = np.uint32
_F16_CHUNK = 65536          # elements per parallel task


@_inline
def _half_bits(v):
    """float32 ``v`` -> its float16 bits: round to nearest even, overflow to inf, a NaN keeps its top
    ten significand bits (one if none). Numba widens uint32 arithmetic: results are cast back."""
    f = np.float32(v).view(np.uint32)
    sign = _H((f >> _H(16)) & _H(0x8000))
    a = _H(f & _H(0x7FFFFFFF))
    fexp = _H(a & _H(0x7F800000))
    sig = _H(a & _H(0x7FFFFF))
    # normal: round on the 13 dropped bits (ties to even), carrying into the exponent
    n = _H(sig + _H(0x1000)) if (sig & _H(0x3FFF)) != _H(0x1000) else sig
    h = _H((n >> _H(13)) + _H(_H(fexp - _H(0x38000000)) >> _H(13)))
    # subnormal: the significand with its hidden bit, shifted by 1..11 more, then rounded likewise
    sh = min(max(np.int32(113) - np.int32(fexp >> _H(23)), np.int32(0)), np.int32(31))
    m = _H(_H(_H(0x800000) + sig) >> _H(sh))
    m = _H(m + _H(0x1000)) if ((m & _H(0x3FFF)) != _H(0x1000)) or (a & _H(0x7FF)) != _H(0) else m
    h = _H(m >> _H(13)) if fexp <= _H(0x38000000) else h
    h = _H(0) if fexp < _H(0x33000000) else h
    h = _H(0x7C00) if fexp >= _H(0x47800000) else h
    h = _H(_H(0x7C00) + max(_H(sig >> _H(13)), _H(1))) if a > _H(0x7F800000) else h
    return np.uint16(sign | h)


@_inline
def _half_value(hb):
    """float16 bits ``hb`` -> their float32 value (exact; a NaN keeps its significand)."""
    h = _H(hb)
    o = _H(_H(h & _H(0x7FFF)) << _H(13))
    e = _H(o & _H(0x0F800000))
    bits = _H(o + _H(0x38000000))
    bits = _H(bits + _H(0x38000000)) if e == _H(0x0F800000) else bits
    sub = np.float32(np.float32(h & _H(0x3FF)) * np.float32(2.0 ** -24)).view(np.uint32)
    bits = sub if e == _H(0) else bits
    return _H(bits | _H(_H(h & _H(0x8000)) << _H(16))).view(np.float32)


@_Kernel
def _half_encode(x, vals, residual, has_res, kchunk):
    n = x.size
    for c in prange((n + kchunk - 1) // kchunk):
        _wide()
        e0 = c * kchunk
        xb = x[e0:min(n, e0 + kchunk)]
        vb = vals[e0:min(n, e0 + kchunk)]
        for j in range(xb.size):
            vb[j] = _half_bits(xb[j])
        if has_res:
            rb = residual[e0:min(n, e0 + kchunk)]
            for j in range(xb.size):
                rb[j] = xb[j] - _half_value(vb[j])


@_Kernel
def _half_decode(vals, out, accumulate, kchunk):
    n = out.size
    for c in prange((n + kchunk - 1) // kchunk):
        _wide()
        e0 = c * kchunk
        vb = vals[e0:min(n, e0 + kchunk)]
        ob = out[e0:min(n, e0 + kchunk)]
        for j in range(vb.size):
            _put(ob, j, _half_value(vb[j]), accumulate)
