"""1-bit SGD's CPU kernels: per-bucket scales from the lane sums, a sign bit per element, and the
fused decode_sum and decode_chunks (``reference.onebit_*_ref``).
"""
import numpy as np
from numba import prange

from ._cpu_base import (_Kernel, _encode_preamble, _inline, _lane_segment, _lane_sums, _lanes, _onebit_scales,
                        _put, _segment_lanes, _tree, _wide, decoders)
from ._scalar import F0, SEGMENT, UFF


@_inline
def _onebit_store(scales, b, two_mean, sp, sq, npos, n):
    hi, lo = _onebit_scales(two_mean, sp, sq, npos, n)
    if two_mean:
        scales[2 * b] = hi
        scales[2 * b + 1] = lo
    else:
        scales[b] = hi


@_inline
def _onebit_pair(scales, b, two_mean):
    """(hi, lo): what bucket b's bits 1 and 0 decode to."""
    if two_mean:
        return scales[2 * b], scales[2 * b + 1]
    return scales[b], -scales[b]


@_inline
def _onebit_bits(x, payload, codes_off, scales, bs, two_mean, e0, e1, residual, has_res):
    """The bits (x >= 0) of x[e0:e1], eight to a byte (e0 a multiple of 8), and their residual."""
    xs = x[e0:e1]
    pb = payload[codes_off + (e0 >> 3):codes_off + ((e1 + 7) >> 3)]
    nw = xs.size >> 6
    for w in range(nw):       # 64 bits in a word, then its 8 bytes (not byte by byte)
        xg = xs[64 * w:64 * w + 64]
        v = np.uint64(0)
        for k in range(64):
            v |= np.uint64(xg[k] >= F0) << np.uint64(k)
        pg = pb[8 * w:8 * w + 8]
        for k in range(8):
            pg[k] = np.uint8((v >> np.uint64(8 * k)) & UFF)
    for j in range(8 * nw, pb.size):
        u = np.int32(0)
        for k in range(min(8, xs.size - 8 * j)):
            u |= np.int32(xs[8 * j + k] >= F0) << k
        pb[j] = np.uint8(u)
    if has_res:     # x - what the decode writes for its bit
        st = e0
        while st < e1:
            b = st // bs
            en = min(e1, b * bs + bs)
            hi, lo = _onebit_pair(scales, b, two_mean)
            xb = x[st:en]
            rb = residual[st:en]
            for j in range(xb.size):
                xv = xb[j]
                rb[j] = xv - (hi if xv >= F0 else lo)
            st = en


@_Kernel
def _onebit_encode(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, two_mean, key, span,
                   residual, has_res):
    """Buckets of at most SEGMENT elements: each task (``span`` elements, whole buckets) takes its
    buckets' sums, then their bits, while in cache. ``key`` (unused) keeps the encodes' signature."""
    numel = x.size
    scales, nb = _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs)
    per = span // bs
    for c in prange((numel + span - 1) // span):
        _wide()
        p, q, cl = _lanes()
        for b in range(c * per, min(nb, c * per + per)):
            st = b * bs
            en = min(numel, st + bs)
            if two_mean:        # (the kind a literal: each loop compiled for its own)
                npos = _lane_sums(x, st, en, 2, p, q, cl)
            else:
                npos = _lane_sums(x, st, en, 3, p, q, cl)
            _onebit_store(scales, b, two_mean, _tree(p), _tree(q), npos, en - st)
        _onebit_bits(x, payload, codes_off, scales, bs, two_mean, c * span, min(numel, c * span + span),
                     residual, has_res)


@_Kernel
def _onebit_encode_long(x, payload, header, codes_off, codes_end, scales_off, nscales, bs, two_mean,
                        key, span, residual, has_res):
    """Buckets of more than SEGMENT elements (``OneBit()``'s one bucket per tensor): every segment's
    sums in parallel, each bucket's scales from them in the canonical order (:func:`_lane_sums`),
    then the bits, ``span`` elements (whole segments) per task."""
    numel = x.size
    scales, nb = _encode_preamble(payload, header, codes_end, scales_off, nscales, numel, bs)
    nseg = (bs + SEGMENT - 1) // SEGMENT
    sp = np.zeros(nb * nseg, np.float32)
    sq = np.zeros(nb * nseg, np.float32)
    sn = np.zeros(nb * nseg, np.int64)
    for t in prange(nb * nseg):
        _wide()
        b = t // nseg
        st = b * bs + (t - b * nseg) * SEGMENT
        en = min(min(numel, b * bs + bs), st + SEGMENT)
        if st < en:
            tp, tq, tc = _lanes()
            if two_mean:
                sn[t] = _lane_segment(x, st, en, 2, tp, tq, tc)
            else:
                sn[t] = _lane_segment(x, st, en, 3, tp, tq, tc)
            sp[t] = _tree(tp)
            sq[t] = _tree(tq)
    # a short last bucket's missing segments add +0.0 (count 0): no lane changes (docs/CODECS.md)
    p, q, _ = _lanes()
    for b in range(nb):
        t = b * nseg
        npos = _segment_lanes(sp[t:t + nseg], sq[t:t + nseg], sn[t:t + nseg], p, q)
        _onebit_store(scales, b, two_mean, _tree(p), _tree(q), npos, min(numel, b * bs + bs) - b * bs)
    for c in prange((numel + span - 1) // span):
        _wide()
        _onebit_bits(x, payload, codes_off, scales, bs, two_mean, c * span, min(numel, c * span + span),
                     residual, has_res)


@_inline
def _onebit_unpack(payload, codes_off, st, ob, hi, lo, accumulate):
    """ob[j] (+)= hi or lo, as bit st + j of the codes is 1 or 0 (a byte at a time from st on a byte)."""
    j0 = 0
    if (st & 7) == 0:
        pb = payload[codes_off + (st >> 3):codes_off + ((st + ob.size) >> 3)]
        for g in range(pb.size):
            v = pb[g]
            og = ob[8 * g:8 * g + 8]
            for k in range(8):
                _put(og, k, hi if (v >> k) & 1 else lo, accumulate)
        j0 = 8 * pb.size
    for j in range(j0, ob.size):
        i = st + j
        _put(ob, j, hi if (payload[codes_off + (i >> 3)] >> (i & 7)) & 1 else lo, accumulate)


@_inline
def _onebit_dec(payload, out, codes_off, scales, bs, two_mean, e0, e1, accumulate, BITS):
    """out[i] (+)= the value of element i of a 1-bit payload, for i in [e0, e1) (a range decoder)."""
    st = e0
    while st < e1:
        b = st // bs
        en = min(e1, b * bs + bs)
        hi, lo = _onebit_pair(scales, b, two_mean)
        if accumulate:
            _onebit_unpack(payload, codes_off, st, out[st:en], hi, lo, True)
        else:
            _onebit_unpack(payload, codes_off, st, out[st:en], hi, lo, False)
        st = en


_onebit_decode, _onebit_decode_sum, _onebit_decode_chunks = decoders(_onebit_dec, "onebit", widths=False)
