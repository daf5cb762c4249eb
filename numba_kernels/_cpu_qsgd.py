"""QSGD's CPU kernels: encode (scales, levels, pack), decode, and the fused decode_sum and
decode_chunks (``reference.qsgd_*_ref``).
"""
import numpy as np
from numba import prange

from ._cpu_base import (_BITS, _DEC_BLOCK, _Widths, _abs_max_bits, _chunk_codes, _draws24,
                        _encode_preamble, _inline, _lane_sums, _lanes, _lookup, _mix64, _pack, _put, _qsgd_level,
                        _sqrt32, _tree, _unpack, _wide, decoders)
from ._scalar import F0, FINF


@_Widths
def _qsgd_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, stochastic,
                 norm_l2, key, kchunk, residual, has_res):
    key = _mix64(key)           # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
    numel = x.size
    scales, nb = _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs)
    scale_bits = scales.view(np.int32)
    xi = x.view(np.int32)
    nchunks = (nb + kchunk - 1) // kchunk
    s = (1 << (_BITS - 1)) - 1
    sf = np.float32(s)
    for c in prange(nchunks):
        _wide()
        p, q, cl = _lanes()
        b0, b1, e0, ng, codes = _chunk_codes(c, kchunk, nb, bs, numel)
        r24 = np.empty(min(bs, numel) if stochastic else 0, np.uint32)
        for b in range(b0, b1):
            st = b * bs
            en = min(numel, st + bs)
            if norm_l2:
                _lane_sums(x, st, en, 1, p, q, cl)
                scales[b] = _sqrt32(_tree(p))
            else:
                scale_bits[b] = _abs_max_bits(xi, st, en)
            scale = scales[b]
            unit = scale / sf
            xb = x[st:en]
            cb = codes[st - e0:en - e0]
            if not (scale > F0 and scale < FINF):       # zero or non-finite: level 0 (decodes to 0 or NaN)
                for j in range(xb.size):
                    cb[j] = s
            elif stochastic:
                _draws24(key, st, en, r24)
                for j in range(xb.size):
                    cb[j] = _qsgd_level(xb[j], unit, sf, s, True, r24[j])
            else:
                for j in range(xb.size):
                    cb[j] = _qsgd_level(xb[j], unit, sf, s, False, np.uint32(0))
            if has_res:     # x - the decode's float32(code - s) * unit (residual may be x)
                rb = residual[st:en]
                for j in range(xb.size):
                    rb[j] = xb[j] - np.float32(cb[j] - s) * unit
        _pack(codes, ng, payload, codes_off + (e0 >> 3) * _BITS, codes_end, _BITS)


@_inline
def _qsgd_dec(payload, out, codes_off, scales, bs, param, e0, e1, accumulate, BITS):
    """out[i] (+)= the value of element i of a QSGD payload, for i in [e0, e1) (``_cpu_base``'s range
    decoder). 8 bits: a value per byte in one vectorised loop; up to 7 bits (buckets of at least K/2
    elements): each code's value once per bucket, then :func:`_lookup`; else unpacked codes."""
    s = np.int32((1 << (BITS - 1)) - 1)
    sf = np.float32(s)
    K = 1 << BITS
    table = K <= 128 and K <= 2 * bs
    book = np.empty(K if table else 1, np.float32)
    codes = np.empty(1 if table or BITS == 8 else _DEC_BLOCK, np.int32)
    b = e0 // bs
    st = e0
    while st < e1:
        en = min(e1, (b + 1) * bs)
        unit = scales[b] / sf
        if BITS == 8:
            ob = out[st:en]
            pb = payload[codes_off + st:codes_off + en]
            for j in range(ob.size):
                _put(ob, j, np.float32(np.int32(pb[j]) - s) * unit, accumulate)
        elif table:
            for c in range(K):
                book[c] = np.float32(np.int32(c) - s) * unit
            _lookup(payload, codes_off, out[st:en], st, book, accumulate, BITS)
        else:
            for s0 in range(st, en, _DEC_BLOCK):
                ob = _unpack(payload, codes_off, out, s0, en, codes, BITS)
                for j in range(ob.size):
                    _put(ob, j, np.float32(codes[j] - s) * unit, accumulate)
        st = en
        b += 1


_qsgd_decode, _qsgd_decode_sum, _qsgd_decode_chunks = decoders(_qsgd_dec, "qsgd")
